//! `ava` in directories another user can write to, end to end (as root, with `nobody`,
//! uid 65534, as the other user; skipped with the reason when not root): a `model` link
//! planted in a run directory owned by someone else is not followed at the end of the run,
//! and a `./ava.yaml` that someone else owns is warned about, or refused under a machine
//! policy with `refuse_foreign_config: true`.

use std::os::unix::fs::{PermissionsExt, chown, lchown, symlink};
use std::process::Output;

mod common;

use common::{ava, ava_command, ok, train_small, usage_error};

/// The other user of these tests.
const NOBODY: u32 = 65534;

/// Whether this process can make files another user's; says why the test is skipped if not.
fn root_or_skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipping {test}: it needs root, to make files owned by uid {NOBODY}");
    }
    root
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The attack: the run directory belongs to another user, who puts a `model` link
/// (to a folder of their choosing, here with a file of the victim's in it) where the run will
/// export its model. The run refuses the link, naming it and its owner, and writes nothing
/// where it points; its checkpoints are saved.
#[test]
fn a_model_link_planted_in_a_run_directory_of_another_user_is_refused() {
    if !root_or_skip("a_model_link_planted_in_a_run_directory_of_another_user_is_refused") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    chown(&run, Some(NOBODY), Some(NOBODY)).unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let model = run.join("model");
    symlink(&elsewhere, &model).unwrap();
    lchown(&model, Some(NOBODY), Some(NOBODY)).unwrap();
    let err = usage_error(train_small(dir.path(), "run", &["--max-steps", "2"]));
    assert!(err.contains(&format!("error: run/model: is a symbolic link (owned by uid {NOBODY})")), "{err}");
    assert!(err.contains("remove it"), "{err}");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing was written where the link points");
    assert!(run.join("checkpoints/step-00000002/manifest.json").is_file(), "{err}");
}

/// A working directory with `ava.yaml` in it, made (with the file) by `owner`.
fn workdir_with_config(file_owner: u32, dir_owner: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("ava.yaml"), "train:\n  lr: 0.002\n").unwrap();
    chown(dir.path().join("ava.yaml"), Some(file_owner), Some(file_owner)).unwrap();
    chown(dir.path(), Some(dir_owner), Some(dir_owner)).unwrap();
    dir
}

#[test]
fn a_config_file_of_another_user_in_the_working_directory_is_warned_about() {
    if !root_or_skip("a_config_file_of_another_user_in_the_working_directory_is_warned_about") {
        return;
    }
    let dir = workdir_with_config(NOBODY, 0);
    let out = ok(ava(dir.path(), &["config", "show"]));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "warning: ./ava.yaml is read as this command's config only because it is in the working directory, but \
             ./ava.yaml belongs to uid {NOBODY}, not to this user (uid 0) or root"
        )),
        "{err}"
    );
    assert!(err.contains("name it (-c ./ava.yaml) or chown it"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("0.002"), "the file is still read");
    // Named, it is the user's choice: no warning.
    let out = ok(ava(dir.path(), &["config", "show", "-c", "./ava.yaml"]));
    assert!(!stderr(&out).contains("belongs to uid"), "{}", stderr(&out));

    // The file is root's but the directory another user's: they could swap it.
    let dir = workdir_with_config(0, NOBODY);
    let err = stderr(&ok(ava(dir.path(), &["config", "show"])));
    assert!(err.contains(&format!("the working directory belongs to uid {NOBODY}")), "{err}");

    // Our own file in our own directory: nothing to say.
    let dir = workdir_with_config(0, 0);
    let err = stderr(&ok(ava(dir.path(), &["config", "show"])));
    assert!(!err.contains("belongs to uid"), "{err}");
}

#[test]
fn a_machine_policy_with_refuse_foreign_config_refuses_it() {
    if !root_or_skip("a_machine_policy_with_refuse_foreign_config_refuses_it") {
        return;
    }
    let dir = workdir_with_config(NOBODY, 0);
    let policies = tempfile::tempdir().unwrap();
    let policy = policies.path().join("policy.yaml");
    std::fs::write(&policy, "refuse_foreign_config: true\n").unwrap();
    std::fs::set_permissions(&policy, std::fs::Permissions::from_mode(0o600)).unwrap();
    let run = |args: &[&str]| ava_command(dir.path(), args).env("AVA_POLICY_FILE", &policy).output().unwrap();
    let err = usage_error(run(&["config", "show"]));
    assert!(err.contains(&format!("./ava.yaml belongs to uid {NOBODY}")), "{err}");
    assert!(
        err.contains(&format!("the machine policy {} refuses it (refuse_foreign_config: true)", policy.display())),
        "{err}"
    );
    assert!(err.contains("-c FILE"), "{err}");
    let err = usage_error(run(&["train", "--max-steps", "1"]));
    assert!(err.contains("refuse_foreign_config"), "{err}");
    // Named explicitly, the user took it on: allowed.
    ok(run(&["config", "show", "-c", "./ava.yaml"]));
    // A policy without the key only warns.
    std::fs::write(&policy, "refuse_foreign_config: false\n").unwrap();
    assert!(stderr(&ok(run(&["config", "show"]))).contains("warning: ./ava.yaml is read"));
}
