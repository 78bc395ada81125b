//! The machine policy: a floor under the plugin settings that a platform team sets once per
//! machine, at a fixed root-owned path, and that no user layer (config file, `AVA__*`,
//! `--set`, `AVA_CONFIG`, `./ava.yaml`) can loosen.
//!
//! ```yaml
//! # /etc/ava/policy.yaml  (owned by root, not writable by others)
//! policy: vetted                          # the least a run may use: open < warn < vetted
//! lock_file: /etc/ava/ava-plugins.lock    # the only lock file honoured
//! search_paths: [/opt/ava/plugins]        # the only directories searched
//! trusted_keys: ["ed25519:9a1f…"]         # the lock must be signed by one of these
//! refuse_foreign_config: true             # ./ava.yaml owned by another user is refused, not warned about
//! ```
//!
//! User layers can only tighten it: a stricter `plugins.policy` is kept, a looser one is
//! raised to the floor. With a `lock_file` or `search_paths` here, the user's are ignored
//! (and `$AVA_PLUGIN_PATH` and the executable's directory are not searched).
//!
//! `$AVA_POLICY_FILE` names one more policy file, for tests and for machines without a
//! platform team. It too can only tighten: with the machine file present, its policy can only
//! be stricter, its paths are used only where the machine file sets none, and its keys only
//! narrow the machine file's.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use ava_fs::bounded::{self, limits};

use crate::{HostError, lock::VettingPolicy, sign::PublicKey, trust};

/// The machine policy's fixed path.
pub const MACHINE_POLICY_FILE: &str = "/etc/ava/policy.yaml";

/// The variable naming one more (tighten-only) policy file.
pub const POLICY_FILE_ENV: &str = "AVA_POLICY_FILE";

/// The floor in force: what the policy files say, merged, and where each part comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct MachinePolicy {
    /// The files read, machine file first.
    pub files: Vec<PathBuf>,
    /// The least policy a run may use, and the file that sets it.
    pub policy: (VettingPolicy, PathBuf),
    /// The only lock file honoured, and the file that sets it.
    pub lock_file: Option<(PathBuf, PathBuf)>,
    /// The only directories searched, and the file that sets them.
    pub search_paths: Option<(Vec<PathBuf>, PathBuf)>,
    /// Keys one of which must have signed the lock file.
    pub trusted_keys: Vec<PublicKey>,
    /// Whether a policy file named keys: the lock must then be signed, even when narrowing
    /// left no key (then no lock verifies, which is the strict answer).
    pub signature_required: bool,
    /// The file that sets `refuse_foreign_config: true`, if one does: a `./ava.yaml` (or
    /// working directory) owned by another user is then refused instead of warned about.
    pub refuse_foreign_config: Option<PathBuf>,
}

/// One policy file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    policy: Option<String>,
    lock_file: Option<PathBuf>,
    search_paths: Option<Vec<PathBuf>>,
    trusted_keys: Option<Vec<String>>,
    refuse_foreign_config: Option<bool>,
}

/// Why an empty policy file is refused: a file put there to set a floor that sets none is
/// a mistake, and treating it as "open" would hide it.
const EMPTY_POLICY: &str = "it sets nothing (it is empty, or holds only comments), so it would set no floor at all; \
     write the floor into it, at least `policy: vetted` (or `warn`, or `open`), with lock_file, search_paths and \
     trusted_keys as needed, or delete the file if this machine is to have no policy";

impl PolicyFile {
    /// Whether no key is set (an empty file, comments only, or keys set to null).
    fn is_empty(&self) -> bool {
        self.policy.is_none()
            && self.lock_file.is_none()
            && self.search_paths.is_none()
            && self.trusted_keys.is_none()
            && self.refuse_foreign_config.is_none()
    }
}

/// One file, checked.
struct Layer {
    path: PathBuf,
    policy: VettingPolicy,
    lock_file: Option<PathBuf>,
    search_paths: Option<Vec<PathBuf>>,
    trusted_keys: Option<Vec<PublicKey>>,
    refuse_foreign_config: bool,
}

impl MachinePolicy {
    /// The floor of this process: [`MACHINE_POLICY_FILE`] and `$AVA_POLICY_FILE`, if any.
    pub fn load() -> Result<Option<MachinePolicy>, HostError> {
        let extra = std::env::var_os(POLICY_FILE_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self::load_from(Path::new(MACHINE_POLICY_FILE), extra.as_deref())
    }

    /// The floor from a machine file (used only if it exists) and an extra file (which must).
    pub fn load_from(machine: &Path, extra: Option<&Path>) -> Result<Option<MachinePolicy>, HostError> {
        let mut layers = Vec::new();
        if std::fs::symlink_metadata(machine).is_ok() {
            layers.push(read_layer(machine, true)?);
        }
        if let Some(extra) = extra {
            layers.push(read_layer(extra, false)?);
        }
        let Some(first) = layers.first() else { return Ok(None) };
        let mut floor = MachinePolicy {
            files: layers.iter().map(|l| l.path.clone()).collect(),
            policy: (first.policy, first.path.clone()),
            lock_file: None,
            search_paths: None,
            trusted_keys: Vec::new(),
            signature_required: false,
            refuse_foreign_config: None,
        };
        let mut keys: Option<Vec<PublicKey>> = None;
        for layer in layers {
            if layer.policy > floor.policy.0 {
                floor.policy = (layer.policy, layer.path.clone());
            }
            if layer.refuse_foreign_config && floor.refuse_foreign_config.is_none() {
                floor.refuse_foreign_config = Some(layer.path.clone());
            }
            if floor.lock_file.is_none() {
                floor.lock_file = layer.lock_file.map(|p| (p, layer.path.clone()));
            }
            if floor.search_paths.is_none() {
                floor.search_paths = layer.search_paths.map(|p| (p, layer.path.clone()));
            }
            keys = match (keys, layer.trusted_keys) {
                (None, k) => k,
                (Some(k), None) => Some(k),
                (Some(k), Some(narrow)) => Some(k.into_iter().filter(|key| narrow.contains(key)).collect()),
            };
        }
        floor.signature_required = keys.is_some();
        floor.trusted_keys = keys.unwrap_or_default();
        Ok(Some(floor))
    }

    /// Whether the lock file must be signed.
    pub fn requires_signature(&self) -> bool {
        self.signature_required
    }
}

fn read_layer(path: &Path, machine: bool) -> Result<Layer, HostError> {
    let bad = |problems: Vec<String>| HostError::Policy { path: path.to_path_buf(), problems };
    if let Some(why) = trust::untrusted_reason(path, "the policy file") {
        return Err(bad(vec![why]));
    }
    if machine {
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata(path).map_err(|e| HostError::io(path, e))?.uid();
        if uid != 0 {
            return Err(bad(vec![format!("the machine policy must belong to root, not to uid {uid}")]));
        }
    }
    let text = bounded::read_to_string(path, limits::LOCK).map_err(|e| bad(vec![e.to_string()]))?;
    let file: PolicyFile = if text.trim().is_empty() {
        PolicyFile::default()
    } else {
        crate::yaml_guard::check(&text, &crate::yaml_guard::YamlLimits::DEFAULT)
            .map_err(|e| bad(vec![format!("not a usable YAML policy: {e}")]))?;
        let value: serde_json::Value = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Yaml))
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| bad(vec![format!("not valid YAML: {e}")]))?;
        serde_json::from_value(value).map_err(|e| {
            bad(vec![format!(
                "{e} (the keys are policy, lock_file, search_paths, trusted_keys, refuse_foreign_config)"
            )])
        })?
    };
    if file.is_empty() {
        return Err(bad(vec![EMPTY_POLICY.into()]));
    }
    let mut problems = Vec::new();
    let policy = match file.policy.as_deref().map(|p| (p, VettingPolicy::parse(p))) {
        None => VettingPolicy::Open,
        Some((_, Some(p))) => p,
        Some((word, None)) => {
            problems.push(format!("policy: '{word}' is not one of open, warn, vetted"));
            VettingPolicy::Open
        }
    };
    let mut absolute = |key: &str, p: &Path| {
        if !p.is_absolute() {
            problems.push(format!(
                "{key}: '{}' is relative; a policy's paths must be absolute (a relative path would follow the directory ava runs in)",
                p.display()
            ));
        }
    };
    if let Some(l) = &file.lock_file {
        absolute("lock_file", l);
    }
    for p in file.search_paths.iter().flatten() {
        absolute("search_paths", p);
    }
    let trusted_keys = file.trusted_keys.map(|keys| {
        keys.iter()
            .filter_map(|k| PublicKey::parse(k).map_err(|e| problems.push(format!("trusted_keys: {e}"))).ok())
            .collect::<Vec<_>>()
    });
    if trusted_keys.as_ref().is_some_and(Vec::is_empty) && problems.is_empty() {
        problems.push("trusted_keys: the list is empty; name at least one key or remove the key".into());
    }
    if !problems.is_empty() {
        return Err(bad(problems));
    }
    Ok(Layer {
        path: path.to_path_buf(),
        policy,
        lock_file: file.lock_file,
        search_paths: file.search_paths,
        trusted_keys,
        refuse_foreign_config: file.refuse_foreign_config.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sign::SecretKey;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn layers_only_tighten() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (SecretKey::generate().unwrap().public(), SecretKey::generate().unwrap().public());
        // No machine file: the extra file alone.
        let extra = write(dir.path(), "extra.yaml", &format!("policy: warn\ntrusted_keys: [\"{a}\", \"{b}\"]\n"));
        let floor = MachinePolicy::load_from(&dir.path().join("none.yaml"), Some(&extra)).unwrap().unwrap();
        assert_eq!(floor.policy.0, VettingPolicy::Warn);
        assert_eq!(floor.trusted_keys, vec![a.clone(), b.clone()]);

        // Machine file vetted with paths and key a; the extra one says open, its own paths and key b.
        let machine = write(
            dir.path(),
            "machine.yaml",
            &format!("policy: vetted\nlock_file: /etc/ava/ava-plugins.lock\ntrusted_keys: [\"{a}\"]\n"),
        );
        let extra = write(
            dir.path(),
            "extra2.yaml",
            &format!("policy: open\nlock_file: /home/x/lock\nsearch_paths: [/opt/p]\ntrusted_keys: [\"{b}\"]\n"),
        );
        let floor = MachinePolicy::load_from(&machine, Some(&extra)).unwrap().unwrap();
        assert_eq!(floor.policy, (VettingPolicy::Vetted, machine.clone()));
        assert_eq!(floor.lock_file, Some((PathBuf::from("/etc/ava/ava-plugins.lock"), machine.clone())));
        assert_eq!(floor.search_paths, Some((vec![PathBuf::from("/opt/p")], extra.clone())));
        // Keys only narrow: b is not among the machine's, so none is left and nothing verifies.
        assert!(floor.trusted_keys.is_empty() && floor.requires_signature());
        assert!(MachinePolicy::load_from(&dir.path().join("none.yaml"), None).unwrap().is_none());
    }

    #[test]
    fn problems_are_collected_and_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let extra = write(
            dir.path(),
            "p.yaml",
            "policy: lax\nlock_file: ava-plugins.lock\nsearch_paths: [plugins]\ntrusted_keys: [\"ed25519:00\"]\n",
        );
        let e = MachinePolicy::load_from(&dir.path().join("none"), Some(&extra)).unwrap_err().to_string();
        for want in [
            extra.display().to_string().as_str(),
            "policy: 'lax' is not one of open, warn, vetted",
            "lock_file: 'ava-plugins.lock' is relative",
            "search_paths: 'plugins' is relative",
            "trusted_keys: 'ed25519:00' is not a public key",
        ] {
            assert!(e.contains(want), "{want:?} not in {e}");
        }
        let extra = write(dir.path(), "q.yaml", "policy: vetted\nsearch_path: [/x]\n");
        let e = MachinePolicy::load_from(&dir.path().join("none"), Some(&extra)).unwrap_err().to_string();
        assert!(e.contains("unknown field `search_path`"), "{e}");
    }

    /// An empty policy file used to mean "no floor" without a word.
    #[test]
    fn an_empty_or_comments_only_policy_file_is_refused_with_what_to_write() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in [("empty.yaml", ""), ("blank.yaml", " \n\t\n"), ("comments.yaml", "# policy: vetted\n\n")] {
            let extra = write(dir.path(), name, text);
            let e = MachinePolicy::load_from(&dir.path().join("none"), Some(&extra)).unwrap_err();
            assert!(matches!(e, HostError::Policy { .. }), "{e:?}");
            let e = e.to_string();
            assert!(
                e.starts_with(&format!("{}: the plugin policy file is not usable: it sets nothing", extra.display())),
                "{e}"
            );
            assert!(e.contains("at least `policy: vetted`") && e.contains("or delete the file"), "{e}");
        }
        // One key is enough.
        let extra = write(dir.path(), "one.yaml", "# the floor\npolicy: warn\n");
        let floor = MachinePolicy::load_from(&dir.path().join("none"), Some(&extra)).unwrap().unwrap();
        assert_eq!(floor.policy.0, VettingPolicy::Warn);
    }

    #[test]
    fn a_policy_file_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let extra = write(dir.path(), "p.yaml", "policy: vetted\n");
        std::fs::set_permissions(&extra, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = MachinePolicy::load_from(&dir.path().join("none"), Some(&extra)).unwrap_err().to_string();
        assert!(e.contains("writable by group and others"), "{e}");
    }
}
