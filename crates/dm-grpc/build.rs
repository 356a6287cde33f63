//! Compiles the example service's `.proto` (tests and examples use it)
//! with protox, a protobuf compiler in Rust: no `protoc` to install.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/imaging.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    // The descriptors themselves, for the reflection service.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("imaging_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        // Large messages by Ref on the direct way.
        .codec_path("crate::Codec")
        // `bytes` fields as `bytes::Bytes`: slices of what arrived.
        .bytes(".")
        .compile_fds(fds.clone())?;
    // The same service with tonic's stock codec (the messages are the
    // ones above), to check that unchanged code works beside it.
    let stock = out.join("stock");
    std::fs::create_dir_all(&stock)?;
    tonic_prost_build::configure()
        .out_dir(&stock)
        .extern_path(".imaging", "crate::example::imaging")
        .compile_fds(fds)?;
    Ok(())
}
