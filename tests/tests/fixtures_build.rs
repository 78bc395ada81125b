//! The fixture workspace builds, every fixture library is where the helpers say, and the
//! complete example in `docs/plugin-authors.md` is the `sign-sgd` fixture, byte for byte.

use std::fs;

use ava_tests::{FIXTURES, fixture, fixtures_dir, repo_root};

#[test]
fn all_fixtures_are_built() {
    let dir = fixtures_dir();
    assert!(dir.ends_with("target/fixtures/debug"), "fixtures built into {}", dir.display());
    for name in FIXTURES {
        let lib = fixture(name);
        assert!(lib.is_file(), "fixture '{name}' not built: {} is missing", lib.display());
        assert_eq!(lib.parent(), Some(dir.as_path()), "fixture '{name}' at {}", lib.display());
        // Each is an abi_stable library: the host finds it by this exported symbol.
        let bytes = fs::read(&lib).unwrap();
        let symbol = ava_core::ffi::ROOT_SYMBOL.as_bytes();
        assert!(
            bytes.windows(symbol.len()).any(|w| w == symbol),
            "fixture '{name}' ({}) does not export {}",
            lib.display(),
            ava_core::ffi::ROOT_SYMBOL
        );
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

/// The doc's example is the fixture crate. The one allowed difference: the doc's
/// Cargo.toml depends on the published `ava-core = "0.2"` where the fixture, built inside
/// this repository, adds a `path` to the repository's own `ava-core`.
#[test]
fn plugin_author_guide_shows_the_sign_sgd_fixture() {
    const FIXTURE_DEP: &str = "ava-core = { version = \"0.2\", path = \"../../../ava-core\" }\n";
    const DOC_DEP: &str = "ava-core = \"0.2\"\n";

    let root = repo_root();
    let doc = fs::read_to_string(root.join("docs/plugin-authors.md")).unwrap();

    let cargo_toml = fs::read_to_string(root.join("tests/fixtures/sign-sgd/Cargo.toml")).unwrap();
    assert_eq!(
        cargo_toml.matches(FIXTURE_DEP).count(),
        1,
        "the fixture's Cargo.toml must contain {FIXTURE_DEP:?} once"
    );
    let expected_toml = cargo_toml.replace(FIXTURE_DEP, DOC_DEP);
    let shown_toml = block_after(&doc, "tests/fixtures/sign-sgd/Cargo.toml");
    assert!(
        shown_toml == expected_toml,
        "docs/plugin-authors.md shows another Cargo.toml than tests/fixtures/sign-sgd/Cargo.toml \
         (with {DOC_DEP:?} for {FIXTURE_DEP:?}):\n--- doc ---\n{shown_toml}--- fixture ---\n{expected_toml}"
    );

    let lib_rs = fs::read_to_string(root.join("tests/fixtures/sign-sgd/src/lib.rs")).unwrap();
    let shown_lib = block_after(&doc, "tests/fixtures/sign-sgd/src/lib.rs");
    if shown_lib != lib_rs {
        let (doc_lines, fixture_lines): (Vec<&str>, Vec<&str>) =
            (shown_lib.lines().collect(), lib_rs.lines().collect());
        let i = (0..doc_lines.len().max(fixture_lines.len()))
            .find(|&i| doc_lines.get(i) != fixture_lines.get(i))
            .unwrap_or(doc_lines.len());
        panic!(
            "docs/plugin-authors.md shows another src/lib.rs than tests/fixtures/sign-sgd/src/lib.rs; \
             first difference at line {}:\n  doc:     {:?}\n  fixture: {:?}",
            i + 1,
            doc_lines.get(i),
            fixture_lines.get(i)
        );
    }
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
