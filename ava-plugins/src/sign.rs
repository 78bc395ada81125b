//! Signed lock files: a platform team signs `ava-plugins.lock` with an ed25519 key
//! (`ava plugins keygen`, `ava plugins sign`); the machine policy names the public keys it
//! trusts, and a lock without a good signature by one of them is refused whole.
//!
//! The signature lives beside the lock (`ava-plugins.lock.sig`) and covers the lock file's
//! exact bytes, prefixed with a domain string so a signature made for anything else never
//! verifies here. The bytes verified are the bytes then parsed.

use std::{
    fmt,
    io::{Read, Write},
    path::{Path, PathBuf},
};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use ava_fs::bounded::{self, limits};

use crate::HostError;

/// Signed before the lock's bytes, so that no other signed text can pass as a lock.
const DOMAIN: &[u8] = b"ava-plugins.lock signature v1\n";
/// How a public key is written in the machine policy and in signatures.
const PUBLIC_PREFIX: &str = "ed25519:";
/// How a secret key file starts.
const SECRET_PREFIX: &str = "ava-ed25519-secret:";

/// A public key, written `ed25519:<64 hex digits>`.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl PublicKey {
    /// Parses `ed25519:<64 hex digits>`.
    pub fn parse(text: &str) -> Result<PublicKey, String> {
        let hex_part = text.trim().strip_prefix(PUBLIC_PREFIX).ok_or_else(|| {
            format!("'{text}' is not a public key: write it as {PUBLIC_PREFIX}<64 hex digits> (`ava plugins keygen` prints it)")
        })?;
        let bytes: [u8; 32] = hex::decode(hex_part)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| format!("'{text}' is not a public key: after {PUBLIC_PREFIX} come 64 hex digits"))?;
        VerifyingKey::from_bytes(&bytes)
            .map(PublicKey)
            .map_err(|_| format!("'{text}' is not a valid ed25519 public key"))
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PUBLIC_PREFIX}{}", hex::encode(self.0.as_bytes()))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A secret signing key, kept in a file only its owner can read.
pub struct SecretKey(SigningKey);

impl SecretKey {
    /// A new key from the operating system's random source.
    pub fn generate() -> std::io::Result<SecretKey> {
        let mut seed = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut seed)?;
        Ok(SecretKey(SigningKey::from_bytes(&seed)))
    }

    /// The public half, to name in the machine policy's `trusted_keys`.
    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }

    /// Writes the key to a new file readable by its owner only; an existing file is never
    /// overwritten (a lost key cannot be recovered).
    pub fn write_new(&self, path: &Path) -> Result<(), HostError> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut file =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    HostError::Lock {
                        path: path.to_path_buf(),
                        reason: "a file is already there; keys are never overwritten: choose another path".into(),
                    }
                } else {
                    HostError::io(path, e)
                }
            })?;
        let text = format!("{SECRET_PREFIX}{}\n", hex::encode(self.0.to_bytes()));
        file.write_all(text.as_bytes()).and_then(|()| file.sync_all()).map_err(|e| HostError::io(path, e))
    }

    /// Reads a key written by [`write_new`](Self::write_new); refuses one others can read.
    pub fn read(path: &Path) -> Result<SecretKey, HostError> {
        use std::os::unix::fs::MetadataExt;
        let bad = |reason: String| HostError::Lock { path: path.to_path_buf(), reason };
        let (file, size) = bounded::open_regular(path, 4096).map_err(|e| bad(e.to_string()))?;
        let mode = file.metadata().map_err(|e| HostError::io(path, e))?.mode();
        if mode & 0o077 != 0 {
            return Err(bad(format!(
                "the secret key is readable by group or others (mode {:o}); fix with chmod 600 {}",
                mode & 0o777,
                path.display()
            )));
        }
        let bytes = bounded::read_opened(file, path, size, 4096).map_err(|e| bad(e.to_string()))?;
        let text = String::from_utf8_lossy(&bytes);
        let seed: [u8; 32] = text
            .trim()
            .strip_prefix(SECRET_PREFIX)
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| bad("not an ava secret key file (make one with `ava plugins keygen`)".into()))?;
        Ok(SecretKey(SigningKey::from_bytes(&seed)))
    }
}

/// Where the signature of the lock file `lock` is kept: `<lock>.sig`.
pub fn signature_path(lock: &Path) -> PathBuf {
    let mut s = lock.as_os_str().to_owned();
    s.push(".sig");
    PathBuf::from(s)
}

/// The signature file's content.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SignatureFile {
    key: String,
    signature: String,
}

/// The text of a signature file for a lock whose bytes are `lock_bytes`.
pub fn sign(lock_bytes: &[u8], key: &SecretKey) -> String {
    let sig = key.0.sign(&[DOMAIN, lock_bytes].concat());
    format!(
        "# Signature of the lock file beside it, by `ava plugins sign`. Re-sign after every change to the lock.\nkey = \"{}\"\nsignature = \"{}\"\n",
        key.public(),
        hex::encode(sig.to_bytes())
    )
}

/// Checks that `sig_text` is a good signature of `lock_bytes` by one of `trusted`; the
/// key that signed it on success, why not otherwise.
pub fn verify(lock_bytes: &[u8], sig_text: &str, trusted: &[PublicKey]) -> Result<PublicKey, String> {
    let file: SignatureFile = toml::from_str(sig_text).map_err(|e| format!("the signature file is malformed ({e})"))?;
    let key = PublicKey::parse(&file.key)?;
    if !trusted.contains(&key) {
        let names = trusted.iter().map(ToString::to_string).collect::<Vec<_>>();
        return Err(format!(
            "it is signed by {key}, which the machine policy does not trust (trusted: {})",
            if names.is_empty() {
                "none: the policy files' trusted_keys have no key in common".into()
            } else {
                names.join(", ")
            }
        ));
    }
    let sig: [u8; 64] = hex::decode(file.signature.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or("the signature is not 128 hex digits")?;
    key.0
        .verify(&[DOMAIN, lock_bytes].concat(), &Signature::from_bytes(&sig))
        .map_err(|_| "the signature does not match the lock file's bytes (changed after signing?)".to_string())?;
    Ok(key)
}

/// Reads the signature beside `lock` and checks it against `lock_bytes`; the error says what
/// to do.
pub fn check_signed(lock: &Path, lock_bytes: &[u8], trusted: &[PublicKey]) -> Result<PublicKey, HostError> {
    let sig_path = signature_path(lock);
    let refuse = |why: String| HostError::Lock {
        path: lock.to_path_buf(),
        reason: format!(
            "{why}; the machine policy accepts only lock files signed by a trusted key: ask whoever holds the key to \
             review the lock and run `ava plugins sign --key KEYFILE {}`",
            lock.display()
        ),
    };
    let text = match bounded::read_to_string(&sig_path, limits::LOCK) {
        Ok(t) => t,
        Err(e) if e.is_missing() => {
            return Err(refuse(format!("it is not signed ({} does not exist)", sig_path.display())));
        }
        Err(e) => return Err(refuse(format!("its signature cannot be read: {e}"))),
    };
    verify(lock_bytes, &text, trusted).map_err(refuse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_for_its_bytes_and_key_only() {
        let key = SecretKey::generate().unwrap();
        let other = SecretKey::generate().unwrap();
        let lock = b"version = 1\n";
        let sig = sign(lock, &key);
        assert_eq!(verify(lock, &sig, &[other.public(), key.public()]).unwrap(), key.public());
        let e = verify(b"version = 1\n\n", &sig, &[key.public()]).unwrap_err();
        assert!(e.contains("does not match the lock file's bytes"), "{e}");
        let e = verify(lock, &sig, &[other.public()]).unwrap_err();
        assert!(e.contains("which the machine policy does not trust"), "{e}");
        let e = verify(lock, "key = 1", &[key.public()]).unwrap_err();
        assert!(e.contains("malformed"), "{e}");
    }

    #[test]
    fn keys_round_trip_and_secret_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("team.key");
        let key = SecretKey::generate().unwrap();
        key.write_new(&path).unwrap();
        assert_eq!(SecretKey::read(&path).unwrap().public(), key.public());
        assert!(key.write_new(&path).unwrap_err().to_string().contains("never overwritten"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(SecretKey::read(&path).err().unwrap().to_string().contains("chmod 600"));
        let public = key.public().to_string();
        assert_eq!(PublicKey::parse(&public).unwrap(), key.public());
        assert!(PublicKey::parse("ed25519:abc").unwrap_err().contains("64 hex digits"));
        assert!(PublicKey::parse(&public[8..]).unwrap_err().contains("write it as ed25519:"));
    }
}
