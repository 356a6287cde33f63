//! Keys that peers share, and the challenge with which each end proves it
//! holds one without sending it.
//!
//! A [`Key`] is 32 bytes: the SHA-256 of a key file's contents (so any
//! secret text works, and `dmrpc key new FILE` writes a random one). A key
//! file must belong to this process's user and be unreadable by group and
//! others, like an ssh private key.
//!
//! The challenge, used by the memory-server protocol and by the TCP
//! transport: each end sends a fresh 16-byte nonce; each proves itself with
//! HMAC-SHA-256 under the key of a context (which protocol), its role and
//! both nonces ([`Key::proof`]). A proof binds both nonces, so it cannot
//! be replayed on another connection, and the two roles' proofs differ, so
//! one end cannot reflect the other's. The key never crosses the wire.
//!
//! What this does not do: it authenticates the peers at the start of a
//! connection, not each byte after it. On a network where someone can
//! change or read packets in flight, carry the connection in a tunnel
//! that encrypts (WireGuard, IPsec, an ssh or TLS tunnel).

use crate::error::{Error, Result};
use hmac::Mac;
use std::path::Path;

type Hmac = hmac::Hmac<sha2::Sha256>;

/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 16;

/// A shared secret. Its `Debug` shows a fingerprint, never the key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({})", self.fingerprint())
    }
}

impl Key {
    /// The key of a secret's bytes (at least 16 of them).
    pub fn from_secret(secret: &[u8]) -> Result<Key> {
        if secret.len() < 16 {
            return Err(Error::InvalidConfig(format!(
                "a key needs a secret of at least 16 bytes, not {}: `dmrpc key new FILE` makes one",
                secret.len()
            )));
        }
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"dmrpc-key-v1");
        h.update(secret);
        Ok(Key(h.finalize().into()))
    }

    /// The key of 32 raw bytes (a pool's secret, say).
    pub fn from_bytes(b: [u8; 32]) -> Key {
        Key(b)
    }

    /// Reads a key file: its contents, without leading and trailing white
    /// space, are the secret. Refused unless the file belongs to this
    /// process's user and neither group nor others may read or write it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Key> {
        use std::os::unix::fs::MetadataExt;
        let path = path.as_ref();
        let io = |e: std::io::Error| {
            Error::InvalidConfig(format!("cannot read key file {}: {e}", path.display()))
        };
        let f = std::fs::File::open(path).map_err(io)?;
        let m = f.metadata().map_err(io)?;
        // SAFETY: geteuid takes no arguments and cannot fail.
        let me = unsafe { libc::geteuid() };
        if m.uid() != me {
            return Err(Error::InvalidConfig(format!(
                "key file {} belongs to user {}, not to this process's user {me}",
                path.display(),
                m.uid()
            )));
        }
        if m.mode() & 0o077 != 0 {
            return Err(Error::InvalidConfig(format!(
                "key file {} may be read by others (mode {:o}): `chmod 600 {}`",
                path.display(),
                m.mode() & 0o777,
                path.display()
            )));
        }
        if m.len() > 1 << 16 {
            return Err(Error::InvalidConfig(format!(
                "key file {} is {} bytes: a key file holds a secret of at most 64 KiB",
                path.display(),
                m.len()
            )));
        }
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, 1 << 16), &mut s).map_err(io)?;
        Key::from_secret(s.trim_ascii())
    }

    /// Writes a new random key file at `path` (mode 0600; refused if the
    /// file exists) and returns its key.
    pub fn generate_file(path: impl AsRef<Path>) -> Result<Key> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.as_ref();
        let mut secret = String::with_capacity(64);
        for _ in 0..4 {
            secret.push_str(&format!("{:016x}", dm_sys::rand::random_u64()));
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    Error::AlreadyExists(path.to_owned())
                } else {
                    Error::InvalidConfig(format!("cannot write key file {}: {e}", path.display()))
                }
            })?;
        f.write_all(secret.as_bytes())
            .and_then(|()| f.write_all(b"\n"))
            .map_err(|e| {
                Error::InvalidConfig(format!("cannot write key file {}: {e}", path.display()))
            })?;
        Key::from_secret(secret.as_bytes())
    }

    /// A short name of the key that does not reveal it (to tell in logs
    /// which key a process uses).
    pub fn fingerprint(&self) -> String {
        let m = self.mac(b"fingerprint", 0, &[0; NONCE_LEN], &[0; NONCE_LEN]);
        let d = m.finalize().into_bytes();
        d[..6].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, context: &[u8], role: u8, a: &[u8; NONCE_LEN], b: &[u8; NONCE_LEN]) -> Hmac {
        let mut m = <Hmac as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        m.update(context);
        m.update(&[role]);
        m.update(a);
        m.update(b);
        m
    }

    /// This end's proof, in `role`, of the nonces `a` (the client's) and
    /// `b` (the server's), for `context` (the protocol).
    pub fn proof(
        &self,
        context: &[u8],
        role: u8,
        a: &[u8; NONCE_LEN],
        b: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.mac(context, role, a, b).finalize().into_bytes().into()
    }

    /// Whether `proof` is the proof of `role` under this key. Compared in
    /// constant time.
    pub fn verify(
        &self,
        context: &[u8],
        role: u8,
        a: &[u8; NONCE_LEN],
        b: &[u8; NONCE_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(context, role, a, b).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    n[..8].copy_from_slice(&dm_sys::rand::random_u64().to_le_bytes());
    n[8..].copy_from_slice(&dm_sys::rand::random_u64().to_le_bytes());
    n
}

/// Whether every address `addr` (`host:port`) resolves to is a loopback
/// address: listening there admits only this host's processes. An
/// address that does not resolve counts as not loopback.
pub fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    match addr.to_socket_addrs() {
        Ok(it) => {
            let v: Vec<_> = it.collect();
            !v.is_empty() && v.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_key_role_context_and_both_nonces() {
        let k = Key::from_secret(b"0123456789abcdef").unwrap();
        let other = Key::from_secret(b"0123456789abcdeg").unwrap();
        let (a, b) = (nonce(), nonce());
        let p = k.proof(b"x", b'C', &a, &b);
        assert!(k.verify(b"x", b'C', &a, &b, &p));
        assert!(!other.verify(b"x", b'C', &a, &b, &p), "another key");
        assert!(!k.verify(b"x", b'S', &a, &b, &p), "the other role");
        assert!(!k.verify(b"y", b'C', &a, &b, &p), "another protocol");
        assert!(!k.verify(b"x", b'C', &b, &a, &p), "nonces swapped");
        assert!(!k.verify(b"x", b'C', &a, &nonce(), &p), "a fresh nonce");
        assert!(!k.verify(b"x", b'C', &a, &b, &p[..31]), "a short proof");
    }

    #[test]
    fn short_secrets_are_refused_and_debug_hides_the_key() {
        assert!(Key::from_secret(b"short").is_err());
        let k = Key::from_secret(b"0123456789abcdef").unwrap();
        let d = format!("{k:?}");
        assert!(d.starts_with("Key(") && d.len() == 17, "{d}");
    }

    #[test]
    fn key_files_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("dm-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("k");
        let k = Key::generate_file(&p).unwrap();
        assert_eq!(Key::from_file(&p).unwrap(), k, "read back");
        assert!(matches!(
            Key::generate_file(&p),
            Err(Error::AlreadyExists(_))
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Key::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        // Written by hand, with a newline: the same key as without.
        let q = dir.join("q");
        std::fs::write(&q, "a secret of some length\n").unwrap();
        std::fs::set_permissions(&q, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            Key::from_file(&q).unwrap(),
            Key::from_secret(b"a secret of some length").unwrap()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loopback_addresses() {
        assert!(is_loopback("127.0.0.1:0"));
        assert!(is_loopback("[::1]:80"));
        assert!(!is_loopback("0.0.0.0:7070"));
        assert!(!is_loopback("10.1.2.3:7070"));
        assert!(!is_loopback("not an address"));
    }
}
