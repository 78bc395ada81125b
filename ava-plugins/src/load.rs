//! Opening one plugin library and checking that it speaks our contract.
//!
//! Each file is opened on its own: the candidate's bytes (already hashed) are written into a
//! private copy that no one else can change ([`crate::private_copy`]: a sealed memory file on
//! Linux), checked against their hash and `dlopen`ed, so the bytes that were vetted are
//! exactly the bytes that run, and no two files share a loader cache entry.
//! We deliberately do not use `RootModule::load_from_file`: it caches one library per root
//! module type in a static, so every later file would silently return the first plugin, and
//! a failed layout check would stick for the whole process.

use std::path::PathBuf;

use abi_stable::{
    library::{LibHeader, LibraryError, RootModule, lib_header_from_path},
    sabi_types::VersionNumber,
};
use ava_core::{
    Manifest,
    ffi::{PluginRootRef, ROOT_MODULE_NAME},
};

use crate::{
    HostError,
    discover::Candidate,
    private_copy::{CopyWay, PrivateCopy},
};

/// An opened, compatible plugin library.
#[derive(Clone)]
pub struct Library {
    /// Where the library was found (not the private copy).
    pub path: PathBuf,
    /// sha256 of the loaded bytes.
    pub sha256: String,
    /// The root module.
    pub root: PluginRootRef,
    /// Its manifest.
    pub manifest: Manifest,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).field("manifest", &self.manifest).finish()
    }
}

/// Opens `candidate` and checks header, contract version, layout and manifest.
pub fn open(candidate: &Candidate) -> Result<Library, HostError> {
    open_copied(candidate, CopyWay::Best)
}

/// [`open`], with the private copy made `way` (the tests of each way use this).
pub fn open_copied(candidate: &Candidate, way: CopyWay) -> Result<Library, HostError> {
    let path = candidate.path.clone();
    candidate.exports_plugin_header().map_err(|reason| HostError::NotAPlugin { path: path.clone(), reason })?;
    let header = dlopen_private_copy(candidate, way)?;

    let consts = header.root_mod_consts();
    if consts.name().as_str() != ROOT_MODULE_NAME {
        return Err(HostError::NotAPlugin {
            path,
            reason: format!("it is an abi_stable library of another application (root module '{}')", consts.name()),
        });
    }
    let built_against = check_version(header, &path)?;
    let root = header.check_layout::<PluginRootRef>().map_err(|e| match e {
        LibraryError::AbiInstability(report) => {
            HostError::LayoutMismatch { path: path.clone(), summary: summarize_layout_error(&report.to_string()) }
        }
        other => HostError::Open { path: path.clone(), reason: first_line(&other.to_string()) },
    })?;

    let manifest = (root.manifest())().into_result().map_err(|error| HostError::NotAPlugin {
        path: path.clone(),
        reason: format!("its manifest could not be read: {error}"),
    })?;
    if let Err(problems) = manifest.validate() {
        return Err(HostError::NotAPlugin {
            path,
            reason: format!("its manifest is invalid: {}", problems.join("; ")),
        });
    }
    manifest
        .check_contract(ava_core::CONTRACT_VERSION)
        .map_err(|reason| HostError::ManifestContract { path: path.clone(), reason })?;
    // The manifest's word against the library's own: a contract the library was not built
    // against (a newer minor this host would accept, say 999) is a wrong manifest.
    if manifest.contract_version != built_against.0 {
        return Err(HostError::ManifestContract {
            path: path.clone(),
            reason: format!(
                "{} '{}' {} declares plugin contract {} in its manifest, but it was built against ava-core {} \
                 (contract {}): its manifest is wrong; build it with ava-core's Manifest::new, which fills in the \
                 contract",
                manifest.kind,
                manifest.name,
                manifest.version,
                manifest.contract_version,
                built_against.1,
                built_against.0
            ),
        });
    }
    Ok(Library { path: candidate.path.clone(), sha256: candidate.sha256.clone(), root, manifest })
}

fn dlopen_private_copy(candidate: &Candidate, way: CopyWay) -> Result<&'static LibHeader, HostError> {
    let path = &candidate.path;
    let copy = PrivateCopy::new(candidate, way)?;
    let header = lib_header_from_path(copy.path());
    // Whatever came of it: the name must never lead to another library (`PrivateCopy::loaded`).
    copy.loaded();
    header.map_err(|e| match e {
        LibraryError::OpenError { err, .. } => {
            HostError::Open { path: path.clone(), reason: first_line(&err.to_string()) }
        }
        LibraryError::GetSymbolError { .. } => {
            HostError::NotAPlugin { path: path.clone(), reason: "it has no abi_stable library header".into() }
        }
        other => HostError::Open { path: path.clone(), reason: first_line(&other.to_string()) },
    })
}

/// The library's ava-core version against ours, with abi_stable's rule for 0.x versions
/// (same minor, or a newer library whose prefix-extended root module an older host can
/// read) but our own message.
/// Returns the library's contract and its ava-core version.
fn check_version(header: &LibHeader, path: &std::path::Path) -> Result<(u32, String), HostError> {
    let ours = VersionNumber::new(<PluginRootRef as RootModule>::VERSION_STRINGS).expect("own version parses");
    let theirs = VersionNumber::new(header.version_strings()).map_err(|e| HostError::NotAPlugin {
        path: path.to_path_buf(),
        reason: format!("its version string cannot be parsed: {e}"),
    })?;
    let contract = |v: &VersionNumber| if v.major == 0 { v.minor } else { v.major * 1000 + v.minor };
    let too_old =
        theirs.major < ours.major || (theirs.major == ours.major && ours.major == 0 && theirs.minor < ours.minor);
    let too_new = theirs.major > ours.major;
    if too_old || too_new {
        return Err(HostError::ContractVersion {
            path: path.to_path_buf(),
            found: contract(&theirs),
            found_crate: theirs.to_string(),
            expected: contract(&ours),
            expected_crate: ours.to_string(),
            hint: if too_old {
                "the plugin is older than this ava: rebuild it against the current ava-core"
            } else {
                "the plugin is newer than this ava: upgrade ava, or rebuild the plugin against this ava's ava-core"
            },
        });
    }
    Ok((contract(&theirs), theirs.to_string()))
}

/// One or two informative lines from abi_stable's (very long) layout report.
///
/// The report is pages of type layouts; each actual problem comes at the end of it as
/// `Error:<what>` / `Expected:` / `<value>` / `Found:` / `<value>` (values indented), which
/// becomes `<what>: expected <value>, found <value>`.
pub(crate) fn summarize_layout_error(report: &str) -> String {
    #[derive(Default)]
    struct Problem<'a> {
        what: &'a str,
        expected: Option<&'a str>,
        found: Option<&'a str>,
    }
    #[derive(PartialEq)]
    enum Want {
        Nothing,
        Expected,
        Found,
    }
    let mut problems: Vec<Problem<'_>> = Vec::new();
    let mut want = Want::Nothing;
    for line in report.lines() {
        if let Some(what) = line.strip_prefix("Error:") {
            problems.push(Problem { what: what.trim(), ..Problem::default() });
            want = Want::Nothing;
        } else if line == "Expected:" || line == "Found:" {
            want = if line == "Expected:" { Want::Expected } else { Want::Found };
        } else if want != Want::Nothing && line.starts_with(' ') && !line.trim().is_empty() {
            if let Some(p) = problems.last_mut() {
                let slot = if want == Want::Expected { &mut p.expected } else { &mut p.found };
                *slot = Some(line.trim());
            }
            want = Want::Nothing;
        } else if !line.trim().is_empty() {
            want = Want::Nothing;
        }
    }
    let summaries: Vec<String> = problems
        .iter()
        .filter(|p| !p.what.is_empty() || p.expected.is_some())
        .take(2)
        .map(|p| {
            let what = if p.what.is_empty() { "layout mismatch" } else { p.what };
            let text = match (p.expected, p.found) {
                (Some(e), Some(f)) => format!("{what}: expected {e}, found {f}"),
                _ => what.to_string(),
            };
            truncate(&text, 160)
        })
        .collect();
    if summaries.is_empty() { truncate(&first_line(report), 160) } else { summaries.join("; ") }
}

fn first_line(s: &str) -> String {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max { s.to_string() } else { format!("{}…", s.chars().take(max).collect::<String>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_report_is_summarized_from_its_errors() {
        let report = "Compared <this>:\n    --- Type Layout ---\n    data:\n        Struct with Fields:\n\n    Phantom fields:\n\n0 error(s).\n\n1 error(s)inside:\n    <other>\n\n    field_name:0\n\nLayout of expected type:\n    size:48\n\n\nError:mismatched package\nExpected:\n    ava-core\nFound:\n    ava-fixture-changed-layout\n\nError:incompatible type size\nExpected:\n    48\nFound:\n    16\n\nError:too many fields\nExpected:\n    6\nFound:\n    2\n";
        assert_eq!(
            summarize_layout_error(report),
            "mismatched package: expected ava-core, found ava-fixture-changed-layout; incompatible type size: expected 48, found 16"
        );
        assert_eq!(summarize_layout_error("something else\nentirely"), "something else");
    }
}
