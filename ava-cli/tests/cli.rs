//! Golden tests for the `ava` command line: `plugins list`, `plugins info`, `plugins vet`,
//! `plugins enable` / `disable` round trips, `config show` / `validate`, JSON errors, help.
//!
//! Every command runs in a fresh temporary directory (so no stray `./ava.yaml` or lock file is
//! picked up) with every `AVA*` variable removed and `NO_COLOR=1`. Output is compared exactly,
//! after replacing machine-specific parts: the temporary directory with `$TMP`, the directory
//! the `ava` binary runs from with `$BIN`, the target directory with `$TARGET`, the repository
//! root with `$REPO` and the sha256 of the lion library with `$SHA` (other libraries' hashes
//! get their own names, e.g. `$SIGN_SHA`).
//!
//! The `ava` binary searches its own directory for plugins. These tests run it from `$BIN`
//! (`<target>/cli-golden`), which holds links to the freshly built `ava` and lion and nothing
//! else, so the listings show lion as the one installed plugin however many plugins the
//! workspace builds next to the real binary.

use std::{
    cell::RefCell,
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use serde_json::Value;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// Machine-specific paths and hashes, computed once.
struct Setup {
    target: PathBuf,
    repo: PathBuf,
    /// The directory the tests run `ava` from: it and lion, nothing else.
    bin: PathBuf,
    /// `ava` in `bin`.
    exe: PathBuf,
    /// Lion in `bin`.
    lion: PathBuf,
    lion_sha: String,
}

fn canon(p: &Path) -> PathBuf {
    fs::canonicalize(p).unwrap_or_else(|e| panic!("cannot canonicalize {}: {e}", p.display()))
}

fn sha256_file(path: &Path) -> String {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Puts `file` into `dir` under its own name: a hard link (cheap; `current_exe` of a hard link
/// is the link, unlike a symlink), or a copy where linking fails. Replaces what was there.
fn install(file: &Path, dir: &Path) -> PathBuf {
    let dest = dir.join(file.file_name().expect("a file name"));
    let _ = fs::remove_file(&dest);
    if fs::hard_link(file, &dest).is_err() {
        fs::copy(file, &dest).unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", file.display(), dest.display()));
    }
    dest
}

/// Builds the workspace plugins (once), then makes `<target>/cli-golden` hold the current
/// `ava` binary and lion library and nothing else.
fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let built_lion = ava_tests::workspace_plugin("lion");
        assert!(built_lion.is_file(), "{} was not built", built_lion.display());
        let target = canon(&ava_tests::main_target_dir());
        let bin = target.join("cli-golden");
        // Emptied first: a stray library left here would show up in every listing.
        let _ = fs::remove_dir_all(&bin);
        fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("cannot create {}: {e}", bin.display()));
        let exe = install(Path::new(env!("CARGO_BIN_EXE_ava")), &bin);
        let lion = install(&built_lion, &bin);
        Setup {
            repo: canon(&ava_tests::repo_root()),
            bin: canon(&bin),
            lion_sha: sha256_file(&lion),
            target,
            exe,
            lion,
        }
    })
}

/// What one run of `ava` printed, normalized.
#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Asserts exit code 0 and an empty stderr; returns stdout.
    #[track_caller]
    fn success(&self) -> &str {
        assert_eq!(self.code, 0, "expected success, got {self:#?}");
        assert_golden(&self.stderr, "");
        &self.stdout
    }

    /// Success of `plugins enable`: stdout, after checking stderr says which runs read the
    /// file it wrote (and nothing else).
    #[track_caller]
    fn enabled(&self) -> &str {
        assert_eq!(self.code, 0, "expected success, got {self:#?}");
        assert!(
            self.stderr.lines().count() == 1
                && (self.stderr.contains("is read by ava commands run in this directory without -c/--config")
                    || self.stderr.starts_with("read by runs with -c ")),
            "{self:#?}"
        );
        &self.stdout
    }

    /// Asserts exit code 2 (usage/config error) and an empty stdout; returns stderr.
    #[track_caller]
    fn usage_error(&self) -> &str {
        assert_eq!(self.code, 2, "expected exit code 2, got {self:#?}");
        assert_golden(&self.stdout, "");
        &self.stderr
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }
}

/// A fresh working directory to run `ava` in.
struct Sandbox {
    dir: tempfile::TempDir,
    root: PathBuf,
    /// Extra (text, placeholder) replacements, e.g. the sha256 of a fixture.
    extra: RefCell<Vec<(String, String)>>,
}

impl Sandbox {
    fn new() -> Self {
        setup();
        let dir = tempfile::tempdir().expect("cannot create a temporary directory");
        let root = canon(dir.path());
        Sandbox { dir, root, extra: RefCell::new(Vec::new()) }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn write(&self, rel: &str, contents: &str) {
        let path = self.path(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).unwrap();
        }
        fs::write(&path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }

    fn read(&self, rel: &str) -> String {
        let path = self.path(rel);
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
    }

    /// A subdirectory with mode 0700 (policy `vetted` refuses group- or world-writable places).
    fn subdir(&self, rel: &str) -> PathBuf {
        let dir = self.path(rel);
        fs::create_dir_all(&dir).unwrap();
        set_mode(&dir, 0o700);
        dir
    }

    /// Copies a library into subdirectory `rel` with mode 0755; returns the copy.
    fn copy_library(&self, lib: &Path, rel: &str) -> PathBuf {
        let copy = ava_tests::copy_to_temp(lib, &self.subdir(rel));
        set_mode(&copy, 0o755);
        copy
    }

    /// Shows `text` as `placeholder` in normalized output.
    fn name(&self, text: &str, placeholder: &str) {
        self.extra.borrow_mut().push((text.to_string(), placeholder.to_string()));
    }

    fn ava(&self, args: &[&str]) -> Out {
        self.ava_env(args, &[])
    }

    fn ava_env(&self, args: &[&str], env: &[(&str, &str)]) -> Out {
        let mut cmd = Command::new(&setup().exe);
        cmd.args(args).current_dir(&self.root).env("NO_COLOR", "1");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("AVA") {
                cmd.env_remove(&key);
            }
        }
        cmd.env_remove("AVA_PLUGIN_PATH").env_remove("AVA_CONFIG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
        Out {
            code: out.status.code().unwrap_or_else(|| panic!("ava was killed by a signal: {out:?}")),
            stdout: self.normalize(&String::from_utf8_lossy(&out.stdout)),
            stderr: self.normalize(&String::from_utf8_lossy(&out.stderr)),
        }
    }

    fn normalize(&self, s: &str) -> String {
        let setup = setup();
        let mut pairs: Vec<(String, String)> = vec![
            (self.root.display().to_string(), "$TMP".into()),
            (self.dir.path().display().to_string(), "$TMP".into()),
            (setup.bin.display().to_string(), "$BIN".into()),
            (setup.target.display().to_string(), "$TARGET".into()),
            (setup.repo.display().to_string(), "$REPO".into()),
            (setup.lion_sha.clone(), "$SHA".into()),
        ];
        pairs.extend(self.extra.borrow().iter().cloned());
        // Longest first, so a path inside another one is replaced by its own name.
        pairs.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
        let mut s = s.to_string();
        for (from, to) in pairs {
            s = s.replace(&from, &to);
        }
        s
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
}

/// Exact comparison; on failure, a line diff (`-` expected, `+` actual).
#[track_caller]
/// `config show` output reduced to its header and the `plugins` section (the engine's
/// sections come first and have tests of their own), with comment alignment collapsed,
/// since the column depends on the widest line of the whole document.
fn show_plugins(out: &str) -> String {
    let header = out.lines().next().unwrap_or_default();
    let plugins = out.find("\nplugins:").map_or(out, |i| &out[i + 1..]);
    let collapsed: Vec<String> = plugins
        .lines()
        .map(|l| match l.find("# from:") {
            Some(i) => format!("{}  {}", l[..i].trim_end(), &l[i..]),
            None => l.to_string(),
        })
        .collect();
    format!("{header}\n{}\n", collapsed.join("\n"))
}

fn assert_golden(actual: &str, expected: &str) {
    if actual == expected {
        return;
    }
    let a: Vec<&str> = expected.split('\n').collect();
    let b: Vec<&str> = actual.split('\n').collect();
    // Longest common subsequence of lines, then walk it.
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let mut diff = String::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            diff.push_str(&format!("  {}\n", a[i]));
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            diff.push_str(&format!("+ {}⏎\n", b[j]));
            j += 1;
        } else {
            diff.push_str(&format!("- {}⏎\n", a[i]));
            i += 1;
        }
    }
    panic!(
        "output differs from the golden (- expected, + actual; ⏎ marks line ends):\n{diff}\n\
         --- actual, verbatim ---\n{actual}--- end ---"
    );
}

/// The listing's rows for the built-in plugins, as `plugins list` prints them.
const BUILTIN_ROWS: &str = "\
standard    attention   0.1.0    builtin  builtin
adamw       optimizer   0.1.0    builtin  builtin
sgd         optimizer   0.1.0    builtin  builtin
full        checkpoint  0.1.0    builtin  builtin
none        checkpoint  0.1.0    builtin  builtin
ram         offload     0.1.0    builtin  builtin
thresholds  memory      0.1.0    builtin  builtin
";

// ---------------------------------------------------------------------------------------------
// The harness itself
// ---------------------------------------------------------------------------------------------

#[test]
fn golden_comparison_fails_on_any_difference() {
    assert_golden("a\nb\n", "a\nb\n");
    for (actual, expected) in [("a\nb\n", "a\nb"), ("a \n", "a\n"), ("a\nc\n", "a\nb\n"), ("", "x")] {
        let r = std::panic::catch_unwind(|| assert_golden(actual, expected));
        assert!(r.is_err(), "{actual:?} vs {expected:?} should differ");
    }
}

#[test]
fn ava_runs_beside_lion_alone_and_paths_are_normalized() {
    let s = Sandbox::new();
    let setup = setup();
    let mut files: Vec<String> =
        fs::read_dir(&setup.bin).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, ["ava", "libava_plugin_lion.so"]);
    assert_eq!(sha256_file(&setup.lion), sha256_file(&ava_tests::workspace_plugin("lion")), "a stale lion in $BIN");
    let text = format!("{} {} {}", s.dir.path().display(), setup.lion.display(), setup.lion_sha);
    assert_golden(&s.normalize(&text), "$TMP $BIN/libava_plugin_lion.so $SHA");
}

// ---------------------------------------------------------------------------------------------
// plugins list
// ---------------------------------------------------------------------------------------------

#[test]
fn plugins_list_text() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "list"]);
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS   SOURCE
{BUILTIN_ROWS}lion        optimizer   0.1.0    loaded   $BIN/libava_plugin_lion.so

policy: open (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
"
        ),
    );
}

#[test]
fn plugins_list_json() {
    let s = Sandbox::new();
    let out = s.ava(&["--format", "json", "plugins", "list"]);
    out.success();
    let rows = out.json();
    let rows = rows.as_array().expect("an array of rows");
    let cols = |key: &str| -> Vec<String> {
        rows.iter().map(|r| r[key].as_str().unwrap_or_else(|| panic!("{key} in {r}")).to_string()).collect()
    };
    assert_eq!(cols("name"), ["standard", "adamw", "sgd", "full", "none", "ram", "thresholds", "lion"]);
    assert_eq!(
        cols("kind"),
        ["attention", "optimizer", "optimizer", "checkpoint", "checkpoint", "offload", "memory", "optimizer"]
    );
    assert_eq!(cols("status"), ["builtin", "builtin", "builtin", "builtin", "builtin", "builtin", "builtin", "loaded"]);
    assert_eq!(cols("version"), vec!["0.1.0"; 8]);
    for r in &rows[..7] {
        assert_eq!(r["source"], "builtin", "{r}");
        assert_eq!(r["sha256"], Value::Null, "{r}");
        assert_eq!(r["reason"], Value::Null, "{r}");
    }
    let lion = &rows[7];
    assert_eq!(lion["source"], "$BIN/libava_plugin_lion.so");
    assert_eq!(lion["sha256"], "$SHA");
    assert_eq!(lion["reason"], Value::Null);
    assert_eq!(
        lion["summary"],
        "Lion: sign of interpolated momentum; one state buffer per parameter (Chen et al. 2023)"
    );
    let mut keys: Vec<&String> = lion.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["kind", "name", "reason", "sha256", "source", "status", "summary", "version"]);
}

#[test]
fn plugins_list_kind_filter() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "list", "--kind", "optimizer"]);
    assert_golden(
        out.success(),
        "\
NAME   KIND       VERSION  STATUS   SOURCE
adamw  optimizer  0.1.0    builtin  builtin
sgd    optimizer  0.1.0    builtin  builtin
lion   optimizer  0.1.0    loaded   $BIN/libava_plugin_lion.so

policy: open (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
",
    );
}

#[test]
fn plugins_list_misspelled_kind_is_a_usage_error() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "list", "--kind", "optimzer"]);
    assert_golden(
        out.usage_error(),
        "error: unknown plugin kind 'optimzer' (did you mean 'optimizer'?); kinds: attention, optimizer, \
         checkpoint, offload, memory\n",
    );
}

#[test]
fn plugins_list_warn_policy_explains_unvetted_once() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "list", "--set", "plugins.policy=warn"]);
    // The reason is in the listing; it is not repeated as a warning on stderr.
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS    SOURCE
{}lion        optimizer   0.1.0    unvetted  $BIN/libava_plugin_lion.so

optimizer 'lion' (unvetted): $BIN/libava_plugin_lion.so is not pinned in the lock file; \
policy 'vetted' would refuse it (pin it with `ava plugins vet $BIN/libava_plugin_lion.so`)

policy: warn (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
",
            BUILTIN_ROWS.replace("builtin  builtin", "builtin   builtin")
        ),
    );
}

#[test]
fn plugins_list_missing_search_path_warns() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "list", "--kind", "memory", "--set", "plugins.search_paths=[nowhere]"]);
    assert_eq!(out.code, 0, "{out:#?}");
    assert_golden(
        &out.stdout,
        "\
NAME        KIND    VERSION  STATUS   SOURCE
thresholds  memory  0.1.0    builtin  builtin

policy: open (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
",
    );
    assert_golden(
        &out.stderr,
        "warning: plugins.search_paths: nowhere is not a directory (build the plugins first with \
         `cargo build --release --workspace`, or fix the path)\n",
    );
    // -q silences warnings.
    let quiet = s.ava(&["-q", "plugins", "list", "--kind", "memory", "--set", "plugins.search_paths=[nowhere]"]);
    assert_golden(quiet.success(), &out.stdout);
}

// ---------------------------------------------------------------------------------------------
// plugins info
// ---------------------------------------------------------------------------------------------

const LION_INFO: &str = "\
lion (optimizer) 0.1.0
  Lion: sign of interpolated momentum; one state buffer per parameter (Chen et al. 2023)

  contract:  3
  devices:   cpu
  source:    $BIN/libava_plugin_lion.so
  sha256:    $SHA
  status:    loaded

options (plugins.optimizer: {name: lion, ...}):
  betas              list of numbers  default [0.9, 0.99]
      [β1, β2]: β1 interpolates momentum and gradient for the update, β2 decays the momentum
";

#[test]
fn plugins_info_lion_text() {
    let s = Sandbox::new();
    assert_golden(s.ava(&["plugins", "info", "lion"]).success(), LION_INFO);
    // By path: the same row, since the file is in a search path.
    let by_path = s.ava(&["plugins", "info", setup().lion.to_str().unwrap()]);
    assert_golden(by_path.success(), LION_INFO);
}

#[test]
fn plugins_info_lion_json() {
    let s = Sandbox::new();
    let out = s.ava(&["--format", "json", "plugins", "info", "lion"]);
    out.success();
    let v = out.json();
    assert_eq!(v["name"], "lion");
    assert_eq!(v["kind"], "optimizer");
    assert_eq!(v["version"], "0.1.0");
    assert_eq!(v["status"], "loaded");
    assert_eq!(v["source"], "$BIN/libava_plugin_lion.so");
    assert_eq!(v["sha256"], "$SHA");
    assert_eq!(v["contract_version"], 3);
    assert_eq!(v["devices"], serde_json::json!(["cpu"]));
    assert_eq!(
        v["options"],
        serde_json::json!([{
            "name": "betas",
            "type": "list of numbers",
            "default": [0.9, 0.99],
            "doc": "[β1, β2]: β1 interpolates momentum and gradient for the update, β2 decays the momentum",
        }])
    );
}

#[test]
fn plugins_info_misspelled_name_suggests() {
    let s = Sandbox::new();
    assert_golden(
        s.ava(&["plugins", "info", "lino"]).usage_error(),
        "error: no plugin named 'lino' (did you mean 'lion'?); `ava plugins list` shows what is installed\n",
    );
}

#[test]
fn plugins_info_builtin_and_missing_file() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "info", "ram"]);
    assert_golden(
        out.success(),
        "\
ram (offload) 0.1.0
  offload to host RAM: records in an in-process map, optionally capped

  contract:  3
  devices:   cpu
  source:    builtin
  status:    builtin

options (plugins.offload: {name: ram, ...}):
  capacity           byte size        default unset
      most bytes the tier may hold (e.g. 16GiB); unset for no limit
",
    );
    assert_golden(
        s.ava(&["plugins", "info", "./missing.so"]).usage_error(),
        "error: ./missing.so: no such plugin file\n",
    );
}

// ---------------------------------------------------------------------------------------------
// plugins vet
// ---------------------------------------------------------------------------------------------

const LION_LOCK: &str = "\
# ava-plugins.lock: plugin libraries vetted for this project, pinned by sha256.
# Written by `ava plugins vet`. Under `plugins.policy: vetted` nothing else is opened.
version = 1

[[plugins]]
name = \"lion\"
kind = \"optimizer\"
version = \"0.1.0\"
sha256 = \"$SHA\"
file = \"libava_plugin_lion.so\"
";

#[test]
fn plugins_vet_lion_by_name_then_list_vetted() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "vet", "lion"]);
    assert_golden(
        out.success(),
        "\
pinned optimizer 'lion' 0.1.0 in ava-plugins.lock
  file:   $BIN/libava_plugin_lion.so
  sha256: $SHA
",
    );
    assert_golden(&s.normalize(&s.read("ava-plugins.lock")), LION_LOCK);

    // Vetting the same bytes again changes nothing.
    assert_golden(s.ava(&["plugins", "vet", "lion"]).success(), &out.stdout);
    assert_golden(&s.normalize(&s.read("ava-plugins.lock")), LION_LOCK);

    let out = s.ava(&["plugins", "list", "--set", "plugins.policy=vetted"]);
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS   SOURCE
{BUILTIN_ROWS}lion        optimizer   0.1.0    vetted   $BIN/libava_plugin_lion.so

policy: vetted (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
"
        ),
    );
}

#[test]
fn plugins_vet_json() {
    let s = Sandbox::new();
    let out = s.ava(&["--format", "json", "plugins", "vet", "lion"]);
    out.success();
    assert_eq!(
        out.json(),
        serde_json::json!({
            "lock_file": "ava-plugins.lock",
            "file": "$BIN/libava_plugin_lion.so",
            "pinned": {
                "name": "lion", "kind": "optimizer", "version": "0.1.0", "sha256": "$SHA",
                "file": "libava_plugin_lion.so",
            },
            "replaced": [],
        })
    );
}

#[test]
fn vetted_policy_refuses_an_unpinned_library_until_it_is_vetted() {
    let s = Sandbox::new();
    let sign = s.copy_library(&ava_tests::fixture("sign-sgd"), "search");
    s.name(&sha256_file(&sign), "$SIGN_SHA");
    let list = ["plugins", "list", "--set", "plugins.policy=vetted", "--set", "plugins.search_paths=[search]"];

    let out = s.ava(&list);
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS   SOURCE
{BUILTIN_ROWS}-           -           -        refused  search/libava_plugin_sign_sgd.so
-           -           -        refused  $BIN/libava_plugin_lion.so

search/libava_plugin_sign_sgd.so (refused): not pinned in the lock file (sha256 $SIGN_SHA); policy \
'vetted' opens only pinned plugins: review it, then pin it with `ava plugins vet search/libava_plugin_sign_sgd.so`
$BIN/libava_plugin_lion.so (refused): not pinned in the lock file (sha256 $SHA); policy \
'vetted' opens only pinned plugins: review it, then pin it with `ava plugins vet $BIN/libava_plugin_lion.so`

policy: vetted (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
"
        ),
    );

    // Vet it by path into a YAML lock file of another name.
    let out = s.ava(&["plugins", "vet", "search/libava_plugin_sign_sgd.so", "--lock", "other.yaml"]);
    assert_golden(
        out.success(),
        "\
pinned optimizer 'sign-sgd' 0.1.0 in other.yaml
  file:   search/libava_plugin_sign_sgd.so
  sha256: $SIGN_SHA
",
    );
    assert_golden(
        &s.normalize(&s.read("other.yaml")),
        "\
# other.yaml: plugin libraries vetted for this project, pinned by sha256.
# Written by `ava plugins vet`. Under `plugins.policy: vetted` nothing else is opened.
version: 1
plugins:
  - name: \"sign-sgd\"
    kind: \"optimizer\"
    version: \"0.1.0\"
    sha256: \"$SIGN_SHA\"
    file: \"libava_plugin_sign_sgd.so\"
",
    );
    assert!(!s.path("ava-plugins.lock").exists(), "--lock other.yaml must not write the default lock file");

    // With that lock file, sign-sgd is vetted (and lion, not pinned there, refused).
    let mut with_lock = list.to_vec();
    with_lock.extend(["--set", "plugins.lock_file=other.yaml"]);
    let out = s.ava(&with_lock);
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS   SOURCE
{BUILTIN_ROWS}sign-sgd    optimizer   0.1.0    vetted   search/libava_plugin_sign_sgd.so
-           -           -        refused  $BIN/libava_plugin_lion.so

$BIN/libava_plugin_lion.so (refused): not pinned in the lock file (sha256 $SHA); policy \
'vetted' opens only pinned plugins: review it, then pin it with `ava plugins vet $BIN/libava_plugin_lion.so`

policy: vetted (from plugins.policy; no machine policy)
lock file: other.yaml (from plugins.lock_file)
"
        ),
    );
}

#[test]
fn vetted_policy_reports_a_modified_library() {
    let s = Sandbox::new();
    let copy = s.copy_library(&setup().lion, "mine");
    assert_golden(
        s.ava(&["plugins", "vet", "mine/libava_plugin_lion.so"]).success(),
        "\
pinned optimizer 'lion' 0.1.0 in ava-plugins.lock
  file:   mine/libava_plugin_lion.so
  sha256: $SHA
",
    );
    // Flip one byte of the pinned copy.
    let mut bytes = fs::read(&copy).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&copy, &bytes).unwrap();
    s.name(&sha256_file(&copy), "$MODIFIED_SHA");

    let out = s.ava(&["plugins", "list", "--set", "plugins.policy=vetted", "--set", "plugins.search_paths=[mine]"]);
    assert_golden(
        out.success(),
        &format!(
            "\
NAME        KIND        VERSION  STATUS    SOURCE
{}-           -           -        modified  mine/libava_plugin_lion.so
lion        optimizer   0.1.0    vetted    $BIN/libava_plugin_lion.so

mine/libava_plugin_lion.so (modified): pinned as optimizer 'lion' 0.1.0 with sha256 $SHA, but the \
file's sha256 is $MODIFIED_SHA; if the change is intended, re-vet it with `ava plugins vet mine/libava_plugin_lion.so`

policy: vetted (from plugins.policy; no machine policy)
lock file: ava-plugins.lock (from plugins.lock_file)
",
            BUILTIN_ROWS.replace("builtin  builtin", "builtin   builtin")
        ),
    );
}

#[test]
fn plugins_vet_unknown_names_and_files_are_usage_errors() {
    let s = Sandbox::new();
    assert_golden(
        s.ava(&["plugins", "vet", "lino"]).usage_error(),
        "error: no plugin library named 'lino' (did you mean 'lion'?) in the search paths: $BIN (the ava \
         executable's directory); `ava plugins list` shows the plugins found. To use a library elsewhere, give \
         its path (e.g. ./libava_plugin_lino.so) or add its directory to plugins.search_paths or \
         $AVA_PLUGIN_PATH\n",
    );
    assert_golden(
        s.ava(&["plugins", "vet", "adamw"]).usage_error(),
        "error: 'adamw' is a built-in optimizer, compiled into ava: there is no library to vet\n",
    );
    assert_golden(
        s.ava(&["plugins", "vet", "nothing/here.so"]).usage_error(),
        "error: nothing/here.so: no such plugin file\n",
    );
    assert!(!s.path("ava-plugins.lock").exists());
}

// ---------------------------------------------------------------------------------------------
// plugins enable / disable
// ---------------------------------------------------------------------------------------------

const CREATED_HEADER: &str = "\
# Ava configuration, created by `ava plugins enable`.
# Settings not written here keep their built-in defaults; `ava config show` prints the
# effective configuration and where each value comes from.
";

#[test]
fn enable_disable_round_trip_in_an_empty_dir() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "enable", "optimizer", "lion", "--set", "betas=[0.9,0.98]"]);
    assert_golden(out.enabled(), "created ava.yaml with plugins.optimizer: {name: lion, betas: [0.9, 0.98]}\n");
    assert_golden(
        &s.read("ava.yaml"),
        &format!("{CREATED_HEADER}plugins:\n  optimizer: {{name: lion, betas: [0.9, 0.98]}}\n"),
    );

    // ./ava.yaml is picked up by `config show`.
    assert_golden(
        &show_plugins(s.ava(&["config", "show"]).success()),
        &show_plugins(
            "\
# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.
plugins:
  attention: standard          # from: default
  optimizer:
    name: lion                 # from: ava.yaml
    betas: [0.9, 0.98]         # from: ava.yaml
  checkpoint: none             # from: default
  offload: ram                 # from: default
  memory: thresholds           # from: default
  search_paths: []             # from: default
  policy: open                 # from: default
  lock_file: ava-plugins.lock  # from: default
",
        ),
    );

    // Enabling the same selection again changes nothing.
    assert_golden(
        s.ava(&["plugins", "enable", "optimizer", "lion", "--set", "betas=[0.9, 0.98]"]).enabled(),
        "ava.yaml already has plugins.optimizer: {name: lion, betas: [0.9, 0.98]}\n",
    );

    assert_golden(
        s.ava(&["plugins", "disable", "optimizer"]).success(),
        "removed plugins.optimizer from ava.yaml; the built-in default 'adamw' applies\n",
    );
    assert_golden(&s.read("ava.yaml"), CREATED_HEADER);
    assert_golden(
        s.ava(&["plugins", "disable", "optimizer"]).success(),
        "ava.yaml has no plugins.optimizer; the built-in default 'adamw' applies\n",
    );
    assert_golden(&s.read("ava.yaml"), CREATED_HEADER);

    // The file exists now: enabling changes it.
    assert_golden(
        s.ava(&["plugins", "enable", "optimizer", "lion"]).enabled(),
        "set plugins.optimizer: lion in ava.yaml\n",
    );
    assert_golden(&s.read("ava.yaml"), &format!("{CREATED_HEADER}plugins:\n  optimizer: lion\n"));
}

/// A config file's key holding terminal escapes (clear the screen, retitle the window) is
/// shown escaped in the error, never sent to the terminal as it is.
#[test]
fn escape_sequences_from_a_config_file_are_shown_not_obeyed() {
    let s = Sandbox::new();
    s.write("evil.yaml", "train:\n  \"x\\e[2J\\e]0;owned\\a\": 1\n");
    let out = s.ava(&["config", "validate", "evil.yaml"]);
    let err = out.usage_error();
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert!(err.contains("x\\u{1b}[2J\\u{1b}]0;owned\\u{7}"), "{err}");
}

/// A plugin enabled without an option it needs names the option and how to give it on this
/// command; nothing is written.
#[test]
fn enable_without_a_needed_option_says_how_to_give_it() {
    let s = Sandbox::new();
    let search = s.copy_library(&ava_tests::workspace_plugin("nvme"), "search");
    let config = format!("plugins:\n  search_paths: [{}]\n", search.parent().unwrap().display());
    s.write("ava.yaml", &config);
    let out = s.ava(&["plugins", "enable", "offload", "nvme"]);
    let err = out.usage_error();
    assert!(err.contains("option 'path' is required"), "{err}");
    assert!(err.contains("give the options here as --set OPTION=VALUE, one --set each"), "{err}");
    assert!(err.contains("`ava plugins info nvme` lists them"), "{err}");
    assert_eq!(s.read("ava.yaml"), config, "nothing written");
}

#[test]
fn enable_disable_json() {
    let s = Sandbox::new();
    let out = s.ava(&["--format", "json", "plugins", "enable", "optimizer", "sgd", "--set", "momentum=0.9"]);
    out.enabled();
    assert_eq!(
        out.json(),
        serde_json::json!({
            "file": "ava.yaml", "key": "plugins.optimizer",
            "value": {"name": "sgd", "momentum": 0.9}, "outcome": "created",
        })
    );
    let out = s.ava(&["--format", "json", "plugins", "disable", "optimizer"]);
    out.success();
    assert_eq!(
        out.json(),
        serde_json::json!({"file": "ava.yaml", "key": "plugins.optimizer", "default": "adamw", "outcome": "changed"})
    );
}

const COMMENTED_YAML: &str = "\
# My project's settings.
plugins:
  # attention kernel
  attention: standard   # keep dense for now
  policy: open

# trailing comment
";

#[test]
fn enable_then_disable_restores_a_commented_yaml_file_exactly() {
    let s = Sandbox::new();
    s.write("my.yaml", COMMENTED_YAML);
    let out = s.ava(&["plugins", "enable", "optimizer", "lion", "--config", "my.yaml", "--set", "betas=[0.9,0.98]"]);
    assert_golden(out.enabled(), "set plugins.optimizer: {name: lion, betas: [0.9, 0.98]} in my.yaml\n");
    assert_golden(
        &s.read("my.yaml"),
        "\
# My project's settings.
plugins:
  # attention kernel
  attention: standard   # keep dense for now
  policy: open
  optimizer: {name: lion, betas: [0.9, 0.98]}

# trailing comment
",
    );
    let out = s.ava(&["plugins", "disable", "optimizer", "-c", "my.yaml"]);
    assert_golden(out.success(), "removed plugins.optimizer from my.yaml; the built-in default 'adamw' applies\n");
    assert_eq!(fs::read(s.path("my.yaml")).unwrap(), COMMENTED_YAML.as_bytes());
    assert!(!s.path("ava.yaml").exists(), "--config my.yaml must not create ./ava.yaml");
}

#[test]
fn enable_with_a_bad_option_changes_nothing() {
    let s = Sandbox::new();
    s.write("ava.yaml", COMMENTED_YAML);
    let out = s.ava(&["plugins", "enable", "optimizer", "lion", "--set", "betas=[1.5]"]);
    assert_golden(
        out.usage_error(),
        "\
error: optimizer 'lion' ($BIN/libava_plugin_lion.so): 2 problems with the options
  - option 'betas': expected 2 values [β1, β2], got 1
  - option 'betas': β1 = 1.5 must be in [0, 1)
",
    );
    assert_eq!(s.read("ava.yaml"), COMMENTED_YAML);

    let out = s.ava(&["plugins", "enable", "optimizer", "lion", "--set", "betas"]);
    assert_golden(out.usage_error(), "error: --set \"betas\": expected OPTION=VALUE, e.g. --set betas=[0.9,0.98]\n");
    assert_eq!(s.read("ava.yaml"), COMMENTED_YAML);
}

#[test]
fn enable_unknown_plugin_or_kind_suggests_and_writes_nothing() {
    let s = Sandbox::new();
    assert_golden(
        s.ava(&["plugins", "enable", "optimizer", "lino"]).usage_error(),
        "error: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd\n",
    );
    assert_golden(
        s.ava(&["plugins", "enable", "optimzer", "lion"]).usage_error(),
        "error: unknown plugin kind 'optimzer' (did you mean 'optimizer'?); kinds: attention, optimizer, \
         checkpoint, offload, memory\n",
    );
    assert_golden(
        s.ava(&["plugins", "enable", "attention", "lion"]).usage_error(),
        "error: 'lion' is an optimizer, not an attention kernel; set it under plugins.optimizer instead\n",
    );
    assert!(!s.path("ava.yaml").exists(), "a refused enable must not create ava.yaml");
}

#[test]
fn enable_disable_with_a_toml_config() {
    let s = Sandbox::new();
    let original = "# toml settings\n[plugins]\npolicy = \"open\"\n";
    s.write("ava.toml", original);
    let out = s.ava(&["plugins", "enable", "optimizer", "lion", "--config", "ava.toml", "--set", "betas=[0.9,0.98]"]);
    assert_golden(out.enabled(), "set plugins.optimizer: {name: lion, betas: [0.9, 0.98]} in ava.toml\n");
    assert_golden(
        &s.read("ava.toml"),
        "\
# toml settings
[plugins]
policy = \"open\"
optimizer = { name = \"lion\", betas = [0.9, 0.98] }
",
    );
    assert_golden(
        &show_plugins(s.ava(&["config", "show", "--config", "ava.toml"]).success()),
        &show_plugins(
            "\
# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.
plugins:
  attention: standard          # from: default
  optimizer:
    name: lion                 # from: ava.toml
    betas: [0.9, 0.98]         # from: ava.toml
  checkpoint: none             # from: default
  offload: ram                 # from: default
  memory: thresholds           # from: default
  search_paths: []             # from: default
  policy: open                 # from: ava.toml
  lock_file: ava-plugins.lock  # from: default
",
        ),
    );
    assert_golden(
        s.ava(&["plugins", "disable", "optimizer", "--config", "ava.toml"]).success(),
        "removed plugins.optimizer from ava.toml; the built-in default 'adamw' applies\n",
    );
    assert_eq!(s.read("ava.toml"), original);
}

// ---------------------------------------------------------------------------------------------
// config validate / show
// ---------------------------------------------------------------------------------------------

/// `ava config validate FILE` on `yaml` must fail with exit code 2 and exactly `stderr`.
#[track_caller]
fn assert_invalid(yaml: &str, stderr: &str) {
    let s = Sandbox::new();
    s.write("bad.yaml", yaml);
    assert_golden(s.ava(&["config", "validate", "bad.yaml"]).usage_error(), stderr);
}

#[test]
fn config_validate_typo_in_a_nested_key() {
    assert_invalid(
        "plugins:\n  polcy: vetted\n",
        "\
error: bad.yaml: 1 problem in the configuration:
  - plugins.polcy: unknown key (did you mean 'plugins.policy'?) [bad.yaml]
",
    );
}

#[test]
fn config_validate_wrong_type() {
    assert_invalid(
        "plugins:\n  search_paths: 3\n",
        "\
error: bad.yaml: 1 problem in the configuration:
  - plugins.search_paths: expected a list of paths, got an integer [bad.yaml]
",
    );
}

#[test]
fn config_validate_out_of_range_threshold() {
    assert_invalid(
        "plugins:\n  memory: {name: thresholds, critical: 1.5}\n",
        "\
error: bad.yaml: 1 problem in the configuration:
  - plugins.memory.critical: 1.5 must be in (0, 1] (a fraction of the budget) [bad.yaml]
",
    );
}

#[test]
fn config_validate_unknown_plugin() {
    assert_invalid(
        "plugins:\n  optimizer: lino\n",
        "\
error: bad.yaml: 1 problem in the configuration:
  - plugins.optimizer: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd [bad.yaml]
",
    );
}

#[test]
fn config_validate_bad_plugin_option() {
    assert_invalid(
        "plugins:\n  optimizer: {name: lion, bogus: 1}\n",
        "\
error: bad.yaml: 1 problem in the configuration:
  - plugins.optimizer.bogus: unknown option (known: betas) [bad.yaml]
",
    );
}

#[test]
fn config_validate_reports_every_problem_at_once() {
    let s = Sandbox::new();
    s.write(
        "all.yaml",
        "\
# every kind of mistake at once
plugins:
  polcy: vetted
  search_paths: 3
  memory: {name: thresholds, critical: 1.5}
  checkpoint: ful
  optimizer: {name: lion, bogus: 1}
",
    );
    // An absolute path: shown as given, so under $TMP.
    let file = s.path("all.yaml");
    let out = s.ava(&["config", "validate", file.to_str().unwrap()]);
    assert_golden(
        out.usage_error(),
        "\
error: $TMP/all.yaml: 5 problems in the configuration:
  - plugins.polcy: unknown key (did you mean 'plugins.policy'?) [$TMP/all.yaml]
  - plugins.search_paths: expected a list of paths, got an integer [$TMP/all.yaml]
  - plugins.memory.critical: 1.5 must be in (0, 1] (a fraction of the budget) [$TMP/all.yaml]
  - plugins.checkpoint: unknown checkpoint policy 'ful' (did you mean 'full'?); installed: full, none [$TMP/all.yaml]
  - plugins.optimizer.bogus: unknown option (known: betas) [$TMP/all.yaml]
",
    );
}

#[test]
fn config_validate_valid_file_and_missing_file() {
    let s = Sandbox::new();
    s.write("good.yaml", "plugins:\n  optimizer: {name: lion, betas: [0.9, 0.98]}\n  checkpoint: full\n");
    assert_golden(s.ava(&["config", "validate", "good.yaml"]).success(), "good.yaml is valid\n");
    assert_golden(
        s.ava(&["config", "validate", "absent.yaml"]).usage_error(),
        "error: absent.yaml: no such config file\n",
    );
}

#[test]
fn config_show_defaults_env_and_set_origins() {
    let s = Sandbox::new();
    s.write("ava.yaml", "plugins:\n  checkpoint: full\n");
    let out =
        s.ava_env(&["config", "show", "--set", "plugins.lock_file=team.lock"], &[("AVA__PLUGINS__POLICY", "warn")]);
    assert_golden(
        &show_plugins(out.success()),
        &show_plugins(
            "\
# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.
plugins:
  attention: standard   # from: default
  optimizer: adamw      # from: default
  checkpoint: full      # from: ava.yaml
  offload: ram          # from: default
  memory: thresholds    # from: default
  search_paths: []      # from: default
  policy: warn          # from: env AVA__PLUGINS__POLICY
  lock_file: team.lock  # from: --set plugins.lock_file=team.lock
",
        ),
    );
}

#[test]
fn config_show_env_override_alone() {
    let s = Sandbox::new();
    let out = s.ava_env(&["config", "show"], &[("AVA__PLUGINS__POLICY", "warn")]);
    assert_golden(
        &show_plugins(out.success()),
        &show_plugins(
            "\
# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.
plugins:
  attention: standard          # from: default
  optimizer: adamw             # from: default
  checkpoint: none             # from: default
  offload: ram                 # from: default
  memory: thresholds           # from: default
  search_paths: []             # from: default
  policy: warn                 # from: env AVA__PLUGINS__POLICY
  lock_file: ava-plugins.lock  # from: default
",
        ),
    );
}

#[test]
fn config_show_reads_ava_config_env() {
    let s = Sandbox::new();
    s.write("other.yaml", "plugins:\n  offload: ram\n");
    let out = s.ava_env(&["config", "show"], &[("AVA_CONFIG", "other.yaml")]);
    assert!(show_plugins(out.success()).contains("  offload: ram  # from: other.yaml\n"), "{out:#?}");
}

// ---------------------------------------------------------------------------------------------
// JSON errors, help
// ---------------------------------------------------------------------------------------------

#[test]
fn json_errors_go_to_stdout_with_the_exit_code() {
    let s = Sandbox::new();
    let out = s.ava(&["--format", "json", "plugins", "info", "nope"]);
    assert_eq!(out.code, 2, "{out:#?}");
    assert_golden(&out.stderr, "");
    assert_eq!(
        out.json(),
        serde_json::json!({
            "error": "no plugin named 'nope' (did you mean 'none'?); `ava plugins list` shows what is installed",
            "caused_by": [],
            "exit_code": 2,
        })
    );
    assert_golden(
        &out.stdout,
        "{\"error\":\"no plugin named 'nope' (did you mean 'none'?); `ava plugins list` shows what is installed\",\
         \"caused_by\":[],\"exit_code\":2}\n",
    );
}

#[test]
fn help_mentions_every_subcommand() {
    let s = Sandbox::new();
    let top = s.ava(&["--help"]);
    let top = top.success();
    for word in ["plugins", "config", "--format", "--quiet", "--verbose"] {
        assert!(top.contains(word), "`ava --help` does not mention {word}:\n{top}");
    }
    let plugins = s.ava(&["plugins", "--help"]);
    let plugins = plugins.success();
    for word in ["list", "info", "vet", "enable", "disable"] {
        assert!(
            plugins.lines().any(|l| l.trim_start().starts_with(word)),
            "`ava plugins --help` lacks {word}:\n{plugins}"
        );
    }
    let config = s.ava(&["config", "--help"]);
    let config = config.success();
    for word in ["show", "validate"] {
        assert!(
            config.lines().any(|l| l.trim_start().starts_with(word)),
            "`ava config --help` lacks {word}:\n{config}"
        );
    }
}

#[test]
fn unknown_subcommand_is_a_usage_error() {
    let s = Sandbox::new();
    let out = s.ava(&["plugins", "lst"]);
    assert_eq!(out.code, 2, "{out:#?}");
    assert!(out.stderr.contains("unrecognized subcommand 'lst'"), "{out:#?}");
}

// ---------------------------------------------------------------------------------------------
// The machine policy floor, signed lock files, refusal messages (issue 20)
// ---------------------------------------------------------------------------------------------

impl Sandbox {
    /// A policy file in the sandbox (mode 0600), for `$AVA_POLICY_FILE`; `$TMP` in `text` is
    /// the sandbox's absolute path.
    fn policy(&self, text: &str) -> String {
        self.write("policy.yaml", &text.replace("$TMP", &self.root.display().to_string()));
        set_mode(&self.path("policy.yaml"), 0o600);
        self.path("policy.yaml").display().to_string()
    }
}

#[test]
fn user_layers_cannot_loosen_the_machine_policy() {
    let s = Sandbox::new();
    s.copy_library(&ava_tests::fixture("sign-sgd"), "search");
    s.subdir("team");
    let policy = s.policy("policy: vetted\nlock_file: $TMP/team/ava-plugins.lock\nsearch_paths: [$TMP/search]\n");
    // Every way a user could lower it: --set, AVA__*, another lock file, another search path.
    let out = s.ava_env(
        &[
            "plugins",
            "list",
            "--set",
            "plugins.policy=open",
            "--set",
            "plugins.lock_file=mine.lock",
            "--set",
            "plugins.search_paths=[elsewhere]",
        ],
        &[("AVA_POLICY_FILE", &policy), ("AVA__PLUGINS__POLICY", "open")],
    );
    let stdout = out.success();
    assert!(stdout.contains("refused  $TMP/search/libava_plugin_sign_sgd.so"), "{stdout}");
    assert!(!stdout.contains("libava_plugin_lion.so"), "the executable's directory is not searched: {stdout}");
    assert!(
        stdout.contains(
            "policy: vetted (from the machine policy $TMP/policy.yaml (it raises plugins.policy 'open' to 'vetted'))\n\
             lock file: $TMP/team/ava-plugins.lock (from the machine policy $TMP/policy.yaml)"
        ),
        "{stdout}"
    );
    let shown = s.ava_env(&["config", "show", "--set", "plugins.policy=open"], &[("AVA_POLICY_FILE", &policy)]);
    assert!(
        shown.success().contains("# in force: plugins.policy vetted (from the machine policy $TMP/policy.yaml"),
        "{shown:#?}"
    );

    // A floor that cannot be read stops everything (exit 2), it never becomes no floor.
    s.write("policy.yaml", "policy: vetted\nlock_file: relative.lock\n");
    let err = s.ava_env(&["plugins", "list"], &[("AVA_POLICY_FILE", &policy)]);
    assert!(err.usage_error().contains("lock_file: 'relative.lock' is relative"), "{err:#?}");
}

#[test]
fn a_lock_file_must_be_signed_by_a_key_the_policy_trusts() {
    let s = Sandbox::new();
    s.copy_library(&ava_tests::fixture("sign-sgd"), "search");
    s.subdir("team");
    let keygen = s.ava(&["--format", "json", "plugins", "keygen", "team/signing.key"]);
    let public = keygen.json()["public_key"].as_str().unwrap().to_string();
    let other = s.ava(&["--format", "json", "plugins", "keygen", "team/other.key"]).json()["public_key"].clone();
    assert!(s.ava(&["plugins", "keygen", "team/signing.key"]).usage_error().contains("never overwritten"));
    let policy = s.policy(&format!(
        "policy: vetted\nlock_file: $TMP/team/ava-plugins.lock\nsearch_paths: [$TMP/search]\ntrusted_keys: [\"{public}\"]\n"
    ));
    let env = [("AVA_POLICY_FILE", policy.as_str())];

    // Vetting by path works before the lock is acceptable; listing then refuses it unsigned.
    s.ava_env(&["plugins", "vet", "search/libava_plugin_sign_sgd.so"], &env).success();
    let err = s.ava_env(&["plugins", "list"], &env);
    let text = err.usage_error();
    assert!(text.contains("$TMP/team/ava-plugins.lock: it is not signed"), "{text}");
    assert!(text.contains("ava plugins sign --key KEYFILE"), "{text}");

    let signed = s.ava_env(&["plugins", "sign", "--key", "team/signing.key"], &env);
    assert!(signed.success().contains(&format!("with {public}")), "{signed:#?}");
    let list = s.ava_env(&["plugins", "list"], &env);
    let listing = list.success();
    assert!(
        listing.contains("sign-sgd    optimizer   0.1.0    vetted   $TMP/search/libava_plugin_sign_sgd.so"),
        "{listing}"
    );
    assert!(listing.contains("must be signed by a key the machine policy trusts"), "{listing}");

    // A change after signing, or another key's signature, is refused whole.
    let lock = s.read("team/ava-plugins.lock");
    s.write("team/ava-plugins.lock", &format!("{lock}\n# edited\n"));
    let text = s.ava_env(&["plugins", "list"], &env).usage_error().to_string();
    assert!(text.contains("does not match the lock file's bytes"), "{text}");
    s.ava_env(&["plugins", "sign", "--key", "team/other.key"], &env).success();
    let text = s.ava_env(&["plugins", "list"], &env).usage_error().to_string();
    assert!(
        text.contains(&format!("it is signed by {}, which the machine policy does not trust", other.as_str().unwrap())),
        "{text}"
    );
}

#[test]
fn a_refused_plugin_is_reported_as_refused_not_unknown() {
    let s = Sandbox::new();
    s.copy_library(&ava_tests::fixture("sign-sgd"), "search");
    s.write("ava.yaml", "plugins: {}\n");
    let out = s.ava(&[
        "config",
        "validate",
        "ava.yaml",
        "--set",
        "plugins.policy=vetted",
        "--set",
        "plugins.search_paths=[search]",
        "--set",
        "plugins.optimizer=sign-sgd",
    ]);
    let text = out.usage_error();
    assert!(
        text.contains(
            "plugins.optimizer: optimizer 'sign-sgd' cannot be used: its library search/libava_plugin_sign_sgd.so \
             was found but was refused: not pinned in the lock file"
        ),
        "{text}"
    );
    assert!(!text.contains("unknown optimizer"), "{text}");
}

#[test]
fn a_lock_file_others_can_change_is_refused_under_vetted() {
    let s = Sandbox::new();
    s.write("ava-plugins.lock", "version = 1\n");
    set_mode(&s.path("ava-plugins.lock"), 0o666);
    let out = s.ava(&["plugins", "list", "--set", "plugins.policy=vetted"]);
    let text = out.usage_error();
    assert!(text.contains("the lock file $TMP/ava-plugins.lock is writable by group and others (mode 666)"), "{text}");
    // Another user's lock file: root can give it away to check; others cannot, and skip.
    set_mode(&s.path("ava-plugins.lock"), 0o644);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped the ownership half: giving a file to another user needs root");
        return;
    }
    std::os::unix::fs::chown(s.path("ava-plugins.lock"), Some(65534), None).unwrap();
    let out = s.ava(&["plugins", "list", "--set", "plugins.policy=vetted"]);
    assert!(out.usage_error().contains("belongs to uid 65534, not to root or to you (uid 0)"), "{out:#?}");
}

// ---------------------------------------------------------------------------------------------
// Outside input (issue 20): each hostile or careless input is a clear, bounded error
// ---------------------------------------------------------------------------------------------

/// A "billion laughs" YAML document: 9 levels of 9 aliases, a few hundred bytes that expand
/// to 9^9 values.
fn alias_bomb() -> String {
    let mut s = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..9 {
        let p = i - 1;
        s.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"));
    }
    s
}

#[test]
fn a_fifo_and_a_device_in_a_search_dir_are_refused_rows_and_list_still_answers() {
    let s = Sandbox::new();
    let dir = s.subdir("plugins");
    let fifo = std::ffi::CString::new(dir.join("libfifo.so").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::os::unix::fs::symlink("/dev/zero", dir.join("libzero.so")).unwrap();
    let out = s.ava(&["plugins", "list", "--set", "plugins.search_paths=[plugins]"]);
    assert_eq!(out.code, 0, "{out:#?}");
    assert!(out.stdout.contains("lion"), "{out:#?}");
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(all.contains("libfifo.so") && all.contains("a FIFO (named pipe), not a regular file"), "{out:#?}");
    assert!(all.contains("libzero.so") && all.contains("a character device, not a regular file"), "{out:#?}");
}

#[test]
fn an_alias_bomb_is_refused_quickly_in_a_file_a_set_value_and_a_variable() {
    let s = Sandbox::new();
    s.write("bomb.yaml", &alias_bomb());
    let err = s.ava(&["config", "validate", "bomb.yaml"]).usage_error().to_string();
    assert!(err.starts_with("error: bomb.yaml:6: the YAML expands to more than 100000 values"), "{err}");
    assert!(err.contains("alias bomb"), "{err}");

    let laughs = "[&a [&b [&c [&d [&e [x,x,x,x,x,x,x,x,x,x],*e,*e,*e,*e,*e,*e,*e,*e,*e],*d,*d,*d,*d,*d,*d,*d,*d,*d],\
                  *c,*c,*c,*c,*c,*c,*c,*c,*c],*b,*b,*b,*b,*b,*b,*b,*b,*b],*a,*a,*a,*a,*a,*a,*a,*a,*a]";
    let err = s.ava(&["config", "show", "--set", &format!("train.lr={laughs}")]).usage_error().to_string();
    assert!(err.contains("--set 'train.lr=") && err.contains("alias bomb"), "{err}");
    let out = s.ava_env(&["config", "show"], &[("AVA__TRAIN__LR", laughs)]);
    let err = out.usage_error();
    assert!(err.contains("train.lr") && err.contains("AVA__TRAIN__LR") && err.contains("alias bomb"), "{err}");
}

#[test]
fn a_non_finite_number_names_its_key() {
    let s = Sandbox::new();
    s.write("nan.yaml", "train:\n  lr: .nan\n");
    assert_golden(
        s.ava(&["config", "validate", "nan.yaml"]).usage_error(),
        "error: nan.yaml:2: train.lr: .nan is not a finite number; write a finite number (e.g. 0.001 or 1e30)\n",
    );
    let err = s.ava(&["config", "show", "--set", "train.lr=-.inf"]).usage_error().to_string();
    assert!(err.contains("train.lr: -.inf is not a finite number"), "{err}");
}

#[test]
fn a_config_json_with_zero_heads_names_the_key_and_the_file() {
    let s = Sandbox::new();
    let model = s.subdir("model");
    let config = fs::read_to_string(setup().repo.join("ava-train/tests/hf/llama3-v4/config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&config).unwrap();
    v["num_attention_heads"] = 0.into();
    fs::write(model.join("config.json"), v.to_string()).unwrap();
    fs::copy(setup().repo.join("ava-train/tests/hf/llama3-v4/model.safetensors"), model.join("model.safetensors"))
        .unwrap();
    let out = s.ava(&["plan", "--budget", "1G", "--set", "model.from=model"]);
    let err = out.usage_error();
    assert!(
        err.contains("model/config.json") && err.contains("num_attention_heads must be an integer from 1"),
        "{err}"
    );
}

#[test]
fn a_damaged_manifest_size_is_a_clear_error() {
    let s = Sandbox::new();
    let ckpt = s.subdir("ckpt/step-00000002");
    fs::write(ckpt.join("model.safetensors"), b"12345678").unwrap();
    let manifest = |bytes: u64| {
        format!(
            "{{\"format\": 1, \"step\": 2, \"files\": {{\"model.safetensors\": {{\"sha256\": \"{}\", \"bytes\": {bytes}}}}}}}\n",
            "0".repeat(64)
        )
    };
    fs::write(ckpt.join("manifest.json"), manifest(u64::MAX)).unwrap();
    let out = s.ava(&["train", "--resume", ckpt.to_str().unwrap()]);
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(out.code != 0 && all.contains("files.model.safetensors.bytes is 18446744073709551615"), "{out:#?}");
    assert!(all.contains("manifest.json is invalid"), "{out:#?}");

    fs::write(ckpt.join("manifest.json"), manifest(1 << 40)).unwrap();
    let out = s.ava(&["train", "--resume", ckpt.to_str().unwrap()]);
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.code != 0 && all.contains("truncated or was changed (8 bytes, the manifest says 1099511627776)"),
        "{out:#?}"
    );
}
