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
        // `bytes` fields as `bytes::Bytes`: slices of what arrived.
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}
