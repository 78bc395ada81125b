//! What an `ava` built without the `mpi` feature (the default build) says when asked for
//! several ranks: `--nproc`, or being started by `mpirun` as one of several ranks (each copy
//! would otherwise train alone on the same data). Both are refused before anything runs,
//! naming the build command, exit 2.
#![cfg(not(feature = "mpi"))]

mod common;

use common::{ava_command, usage_error};

#[test]
fn nproc_without_mpi_support_says_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    let e = usage_error(ava_command(dir.path(), &["train", "--nproc", "2"]).output().unwrap());
    assert!(e.contains("--nproc 2 runs 2 ranks over MPI, but this ava was built without MPI support"), "{e}");
    assert!(e.contains("cargo build --release -p ava-cli --features mpi"), "{e}");
    assert!(!dir.path().join("runs").exists(), "nothing ran");
}

#[test]
fn a_rank_of_an_mpi_job_without_mpi_support_refuses_to_train_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = ava_command(dir.path(), &["train", "--max-steps", "1"]);
    let e = usage_error(cmd.env("OMPI_COMM_WORLD_SIZE", "2").output().unwrap());
    assert!(e.contains("started by an MPI launcher as one of 2 ranks, but it was built without MPI support"), "{e}");
    assert!(!dir.path().join("runs").exists(), "nothing ran");
}
