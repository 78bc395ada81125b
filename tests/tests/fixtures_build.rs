//! The fixture workspace builds, every fixture library is where the helpers say, and the
//! complete example in `docs/plugin-authors.md` is the `sign-sgd` fixture, byte for byte (its
//! GPU side built by an ignored test where nvcc is installed).

use std::{fs, path::Path};

use ava_tests::{FIXTURES, fixture, fixture_with_features, fixtures_dir, repo_root};

/// Asserts that `lib` is an abi_stable library: the host finds a plugin by this exported symbol.
fn assert_exports_root_symbol(name: &str, lib: &Path) {
    let bytes = fs::read(lib).unwrap_or_else(|e| panic!("fixture '{name}': cannot read {}: {e}", lib.display()));
    let symbol = ava_core::ffi::ROOT_SYMBOL.as_bytes();
    assert!(
        bytes.windows(symbol.len()).any(|w| w == symbol),
        "fixture '{name}' ({}) does not export {}",
        lib.display(),
        ava_core::ffi::ROOT_SYMBOL
    );
}

#[test]
fn all_fixtures_are_built() {
    let dir = fixtures_dir();
    assert!(dir.ends_with("target/fixtures/debug"), "fixtures built into {}", dir.display());
    for name in FIXTURES {
        let lib = fixture(name);
        assert!(lib.is_file(), "fixture '{name}' not built: {} is missing", lib.display());
        assert_eq!(lib.parent(), Some(dir.as_path()), "fixture '{name}' at {}", lib.display());
        assert_exports_root_symbol(name, &lib);
    }
    let names: Vec<String> =
        FIXTURES.iter().map(|n| fixture(n).file_name().unwrap().to_string_lossy().into()).collect();
    assert_eq!(
        names,
        [
            "libava_fixture_canary.so",
            "libava_fixture_panicky.so",
            "libava_fixture_old_contract.so",
            "libava_fixture_changed_layout.so",
            "libava_fixture_foreign_abi.so",
            "libava_plugin_sign_sgd.so",
        ]
        .map(|n| n.replace("lib", std::env::consts::DLL_PREFIX).replace(".so", std::env::consts::DLL_SUFFIX))
    );
}

#[test]
#[should_panic(expected = "no fixture 'nope'")]
fn unknown_fixture_is_refused() {
    fixture("nope");
}

/// The fenced block right after the line `<!-- fixture: PATH -->` in `doc`.
fn block_after(doc: &str, path: &str) -> String {
    let marker = format!("<!-- fixture: {path} -->");
    let mut lines = doc.split_inclusive('\n').skip_while(|l| l.trim_end() != marker);
    assert!(lines.next().is_some(), "docs/plugin-authors.md has no line {marker:?}");
    let fence = lines.next().unwrap_or_else(|| panic!("nothing after {marker:?}"));
    assert!(fence.starts_with("```"), "{marker:?} is not followed by a fenced block but {fence:?}");
    let mut block = String::new();
    for line in lines {
        if line.trim_end() == "```" {
            return block;
        }
        block.push_str(line);
    }
    panic!("the block after {marker:?} is not closed");
}

/// Panics, naming the first differing line, unless the doc shows `fixture` (the text of
/// `path`, as the doc should show it) as `shown`.
fn assert_shown(path: &str, shown: &str, fixture: &str, note: &str) {
    if shown != fixture {
        let (doc_lines, fixture_lines): (Vec<&str>, Vec<&str>) = (shown.lines().collect(), fixture.lines().collect());
        let i = (0..doc_lines.len().max(fixture_lines.len()))
            .find(|&i| doc_lines.get(i) != fixture_lines.get(i))
            .unwrap_or(doc_lines.len());
        panic!(
            "docs/plugin-authors.md shows another file than {path}{note}; first difference at line {}:\n  \
             doc:     {:?}\n  fixture: {:?}",
            i + 1,
            doc_lines.get(i),
            fixture_lines.get(i)
        );
    }
}

/// The doc's example is the fixture crate. The one allowed difference: the doc's
/// Cargo.toml depends on the published crates (`ava-core = "0.3"`, ...) where the fixture,
/// built inside this repository, adds a `path` to the repository's own copies.
#[test]
fn plugin_author_guide_shows_the_sign_sgd_fixture() {
    /// (the fixture's line, the doc's line).
    const DEPS: [(&str, &str); 3] = [
        ("ava-core = { version = \"0.3\", path = \"../../../ava-core\" }\n", "ava-core = \"0.3\"\n"),
        (
            "ava-kernels = { version = \"0.1\", path = \"../../../ava-kernels\", optional = true }\n",
            "ava-kernels = { version = \"0.1\", optional = true }\n",
        ),
        ("ava-cuda-build = { version = \"0.1\", path = \"../../../ava-cuda-build\" }\n", "ava-cuda-build = \"0.1\"\n"),
    ];

    let root = repo_root();
    let doc = fs::read_to_string(root.join("docs/plugin-authors.md")).unwrap();

    let path = "tests/fixtures/sign-sgd/Cargo.toml";
    let mut cargo_toml = fs::read_to_string(root.join(path)).unwrap();
    for (fixture_dep, doc_dep) in DEPS {
        assert_eq!(cargo_toml.matches(fixture_dep).count(), 1, "{path} must contain {fixture_dep:?} once");
        cargo_toml = cargo_toml.replace(fixture_dep, doc_dep);
    }
    assert_shown(path, &block_after(&doc, path), &cargo_toml, " (with the published dependencies, without paths)");

    for file in ["src/lib.rs", "build.rs", "kernels/sign_sgd.cu"] {
        let path = format!("tests/fixtures/sign-sgd/{file}");
        let text = fs::read_to_string(root.join(&path)).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
        assert_shown(&path, &block_after(&doc, &path), &text, "");
    }
}

/// The guide's GPU example builds: the sign-sgd fixture with its `cuda` feature, its kernel
/// made into PTX by nvcc, into a target directory of its own. No GPU and no CUDA library are
/// needed (the plugin loads the driver at run time), only nvcc and `CUDA_COMPUTE_CAP`.
#[test]
#[ignore = "needs nvcc: .ci/run runs it after sourcing tools/cuda-build-env.sh"]
fn sign_sgd_fixture_builds_with_cuda() {
    let lib = fixture_with_features("sign-sgd", &["cuda"], "fixtures-cuda");
    assert!(lib.is_file(), "the sign-sgd fixture built with cuda is missing: {}", lib.display());
    let file = format!("{}ava_plugin_sign_sgd{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    assert!(lib.ends_with(Path::new("target/fixtures-cuda/debug").join(file)), "built at {}", lib.display());
    assert_exports_root_symbol("sign-sgd", &lib);
}

#[test]
fn workspace_plugins_are_built() {
    let packages = ava_tests::workspace_plugin_packages();
    assert!(packages.iter().any(|p| p == "ava-plugin-lion"), "plugins/ packages: {packages:?}");
    let lion = ava_tests::workspace_plugin("lion");
    assert!(lion.is_file(), "{} is missing", lion.display());
    assert_eq!(lion.parent(), Some(ava_tests::workspace_plugins_dir().as_path()));
    assert!(lion.starts_with(ava_tests::main_target_dir()), "{} is not in the main target dir", lion.display());
}
