//! What a plugin says about itself before anything is constructed.

use std::fmt;

use abi_stable::{
    StableAbi,
    std_types::{RString, RVec},
};

use crate::CONTRACT_VERSION;

/// The five kinds of plugin.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginKind {
    /// [`crate::Optimizer`].
    Optimizer = 0,
    /// [`crate::AttentionKernel`].
    Attention = 1,
    /// [`crate::CheckpointPolicy`].
    Checkpoint = 2,
    /// [`crate::OffloadTier`].
    Offload = 3,
    /// [`crate::MemoryPolicy`].
    Memory = 4,
}

impl PluginKind {
    /// All kinds, in config order.
    pub const ALL: [PluginKind; 5] = [Self::Attention, Self::Optimizer, Self::Checkpoint, Self::Offload, Self::Memory];

    /// The key used in `plugins.<key>` of the config and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Optimizer => "optimizer",
            Self::Attention => "attention",
            Self::Checkpoint => "checkpoint",
            Self::Offload => "offload",
            Self::Memory => "memory",
        }
    }

    /// A phrase for messages: "an optimizer", "an attention kernel", ...
    pub fn article_noun(self) -> &'static str {
        match self {
            Self::Optimizer => "an optimizer",
            Self::Attention => "an attention kernel",
            Self::Checkpoint => "a checkpoint policy",
            Self::Offload => "an offload tier",
            Self::Memory => "a memory policy",
        }
    }

    /// Parses the config key (also accepts a few obvious synonyms).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "optimizer" | "optim" => Self::Optimizer,
            "attention" | "attn" => Self::Attention,
            "checkpoint" | "checkpointing" => Self::Checkpoint,
            "offload" => Self::Offload,
            "memory" | "memory-policy" => Self::Memory,
            _ => return None,
        })
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A device whose buffers a plugin takes directly (see [`Manifest::devices`]).
///
/// Each device has its own calls: `Cpu` the host-slice methods ([`crate::Optimizer::step`],
/// [`crate::AttentionKernel::forward`] and `backward`), `Cuda` the device-buffer methods
/// ([`crate::Optimizer::step_cuda`], [`crate::AttentionKernel::forward_cuda`] and
/// `backward_cuda`, with [`crate::CudaBuf`]s and a [`crate::CudaStream`]). No call hands a
/// plugin Metal buffers yet.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host CPU.
    Cpu = 0,
    /// NVIDIA CUDA.
    Cuda = 1,
    /// Apple Metal.
    Metal = 2,
}

impl Device {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Metal => "metal",
        }
    }
}

/// The type of one option value, checked by [`crate::Options::parse`].
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptionType {
    /// `true` / `false`.
    Bool = 0,
    /// A whole number (may be negative).
    Int = 1,
    /// A number; whole numbers are accepted.
    Float = 2,
    /// Text.
    String = 3,
    /// A list of numbers, e.g. `[0.9, 0.999]`.
    FloatList = 4,
    /// A list of whole numbers.
    IntList = 5,
    /// A list of text values.
    StringList = 6,
    /// A byte size: a whole number of bytes or text such as `1.5GiB`, `512MB`.
    Size = 7,
}

impl OptionType {
    /// The type's name as written in docs and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bool => "bool",
            Self::Int => "integer",
            Self::Float => "number",
            Self::String => "string",
            Self::FloatList => "list of numbers",
            Self::IntList => "list of integers",
            Self::StringList => "list of strings",
            Self::Size => "byte size",
        }
    }
}

/// One option a plugin accepts.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct OptionSpec {
    /// Key in the plugin's config table (snake_case).
    pub name: RString,
    /// Type of the value.
    pub ty: OptionType,
    /// Default as JSON text; `null` means "not set unless given".
    pub default: RString,
    /// One line for `ava plugins info`.
    pub doc: RString,
}

impl OptionSpec {
    /// A spec with a JSON default.
    pub fn new(name: &str, ty: OptionType, default_json: &str, doc: &str) -> Self {
        Self { name: name.into(), ty, default: default_json.into(), doc: doc.into() }
    }
    /// A number option.
    pub fn float(name: &str, default: f64, doc: &str) -> Self {
        Self::new(name, OptionType::Float, &json_number(default), doc)
    }
    /// A whole-number option.
    pub fn int(name: &str, default: i64, doc: &str) -> Self {
        Self::new(name, OptionType::Int, &default.to_string(), doc)
    }
    /// A bool option.
    pub fn bool(name: &str, default: bool, doc: &str) -> Self {
        Self::new(name, OptionType::Bool, if default { "true" } else { "false" }, doc)
    }
    /// A text option.
    pub fn string(name: &str, default: &str, doc: &str) -> Self {
        Self::new(name, OptionType::String, &serde_json::Value::from(default).to_string(), doc)
    }
    /// A list-of-numbers option.
    pub fn float_list(name: &str, default: &[f64], doc: &str) -> Self {
        let items: Vec<String> = default.iter().map(|v| json_number(*v)).collect();
        Self::new(name, OptionType::FloatList, &format!("[{}]", items.join(", ")), doc)
    }
    /// An option of `ty` with no default (absent unless given).
    pub fn optional(name: &str, ty: OptionType, doc: &str) -> Self {
        Self::new(name, ty, "null", doc)
    }
}

/// Why a plugin's contract cannot be used by a host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ContractGap {
    TooOld,
    TooNew,
}

/// The compatibility rule of contract numbers (see [`Manifest::check_contract`]).
fn contract_gap(plugin: u32, host: u32) -> Option<ContractGap> {
    let (plugin_major, host_major) = (plugin / 1000, host / 1000);
    if plugin_major > host_major {
        Some(ContractGap::TooNew)
    } else if plugin_major < host_major || (host_major == 0 && plugin < host) {
        Some(ContractGap::TooOld)
    } else {
        None
    }
}

fn json_number(v: f64) -> String {
    serde_json::Number::from_f64(v).map(|n| n.to_string()).unwrap_or_else(|| "null".into())
}

/// Everything the host learns about a plugin before constructing it.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Stable kebab-case name used in configs (`adam-8bit`).
    pub name: RString,
    /// Which trait it implements.
    pub kind: PluginKind,
    /// The plugin's own version (semver).
    pub version: RString,
    /// [`CONTRACT_VERSION`] the plugin was built against.
    pub contract_version: u32,
    /// One line for listings.
    pub summary: RString,
    /// Options it accepts.
    pub options: RVec<OptionSpec>,
    /// The devices whose buffers the plugin takes directly; [`Manifest::new`] says `[Cpu]`.
    ///
    /// For an optimizer or an attention kernel each entry is a promise: `Cpu` that the
    /// host-slice calls work, `Cuda` that [`step_cuda`](crate::Optimizer::step_cuda), or
    /// [`forward_cuda`](crate::AttentionKernel::forward_cuda) (and
    /// [`backward_cuda`](crate::AttentionKernel::backward_cuda) if the kernel
    /// [`supports_backward`](crate::AttentionKernel::supports_backward)), are implemented.
    /// On a CUDA run the host refuses, by name and before training, an optimizer or kernel
    /// whose list lacks `Cuda`: it never copies device buffers to the host for a plugin.
    ///
    /// Checkpoint policies and memory policies only return decisions, and offload tiers
    /// move host bytes: the host never hands them device buffers, so for those kinds the
    /// list does not restrict a CUDA run.
    pub devices: RVec<Device>,
}

impl Manifest {
    /// A CPU plugin with no options; add them with [`option`](Self::option).
    pub fn new(name: &str, kind: PluginKind, version: &str, summary: &str) -> Self {
        Self {
            name: name.into(),
            kind,
            version: version.into(),
            contract_version: CONTRACT_VERSION,
            summary: summary.into(),
            options: RVec::new(),
            devices: RVec::from(vec![Device::Cpu]),
        }
    }

    /// Adds an option spec.
    pub fn option(mut self, spec: OptionSpec) -> Self {
        self.options.push(spec);
        self
    }

    /// Replaces the device list (see the `devices` field for what it promises): e.g.
    /// `.devices(&[Device::Cpu, Device::Cuda])` for a plugin with both kinds of call.
    pub fn devices(mut self, devices: &[Device]) -> Self {
        self.devices = devices.iter().copied().collect();
        self
    }

    /// Whether the plugin takes buffers on `device` directly (its manifest lists it).
    pub fn runs_on(&self, device: Device) -> bool {
        self.devices.contains(&device)
    }

    /// The spec of option `name`.
    pub fn option_spec(&self, name: &str) -> Option<&OptionSpec> {
        self.options.iter().find(|o| o.name.as_str() == name)
    }

    /// Checks the manifest's [`contract_version`](Self::contract_version) against the host's
    /// ([`CONTRACT_VERSION`]) with the rule of the library's version check: the contract is
    /// the ava-core minor version while ava-core is 0.x (`major * 1000 + minor` after), a
    /// plugin of an older contract is too old, one of a newer major too new. The error says
    /// which plugin, both contracts and what to do.
    pub fn check_contract(&self, host: u32) -> Result<(), String> {
        let gap = contract_gap(self.contract_version, host);
        let hint = match gap {
            None => return Ok(()),
            Some(ContractGap::TooOld) => "the plugin is older than this ava: rebuild it against the current ava-core",
            Some(ContractGap::TooNew) => {
                "the plugin is newer than this ava: upgrade ava, or rebuild the plugin against this ava's ava-core"
            }
        };
        Err(format!(
            "{} '{}' {} declares plugin contract {} in its manifest, but this ava speaks contract {host}; {hint}",
            self.kind, self.name, self.version, self.contract_version
        ))
    }

    /// Checks the manifest's own invariants (kebab-case name, parseable defaults); the host
    /// refuses a plugin whose manifest fails this.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        let name = self.name.as_str();
        let kebab = !name.is_empty()
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !name.starts_with('-')
            && !name.ends_with('-');
        if !kebab {
            problems.push(format!("plugin name {name:?} is not kebab-case (a-z, 0-9, '-')"));
        }
        for spec in self.options.iter() {
            let parsed: Result<serde_json::Value, _> = serde_json::from_str(&spec.default);
            match parsed {
                Err(e) => problems.push(format!("option '{}': default {:?} is not JSON: {e}", spec.name, spec.default)),
                Ok(v) if !v.is_null() => {
                    if let Err(e) = crate::options::check_type(spec.ty, &v) {
                        problems.push(format!("option '{}': default {}", spec.name, e));
                    }
                }
                Ok(_) => {}
            }
            if spec.name.as_str() == "name" {
                problems.push("an option may not be called 'name' (it selects the plugin)".into());
            }
        }
        if problems.is_empty() { Ok(()) } else { Err(problems) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest's contract_version used to be displayed and never checked.
    #[test]
    fn a_manifest_of_another_contract_is_refused_naming_both() {
        let mut m = Manifest::new("lion", PluginKind::Optimizer, "0.3.0", "test");
        assert_eq!(m.check_contract(CONTRACT_VERSION), Ok(()));
        m.contract_version = CONTRACT_VERSION - 1;
        assert_eq!(
            m.check_contract(CONTRACT_VERSION).unwrap_err(),
            format!(
                "optimizer 'lion' 0.3.0 declares plugin contract {} in its manifest, but this ava speaks contract \
                 {CONTRACT_VERSION}; the plugin is older than this ava: rebuild it against the current ava-core",
                CONTRACT_VERSION - 1
            )
        );
        m.contract_version = 1000;
        assert!(m.check_contract(CONTRACT_VERSION).unwrap_err().contains(&format!(
            "declares plugin contract 1000 in its manifest, but this ava speaks contract {CONTRACT_VERSION}; the plugin \
             is newer than this ava"
        )));
        // 0.x: a newer minor is the library check's "prefix-extended" case; after 1.0, the major decides.
        assert_eq!(contract_gap(3, 1), None);
        assert_eq!(contract_gap(1001, 1005), None);
        assert_eq!(contract_gap(1005, 2000), Some(ContractGap::TooOld));
        assert_eq!(contract_gap(2000, 1005), Some(ContractGap::TooNew));
    }

    #[test]
    fn runs_on_reads_the_device_list() {
        let m = Manifest::new("sign-sgd", PluginKind::Optimizer, "0.2.0", "test");
        assert!(m.runs_on(Device::Cpu));
        assert!(!m.runs_on(Device::Cuda));
        let m = m.devices(&[Device::Cpu, Device::Cuda]);
        assert!(m.runs_on(Device::Cpu) && m.runs_on(Device::Cuda) && !m.runs_on(Device::Metal));
        let m = m.devices(&[Device::Cuda]);
        assert!(!m.runs_on(Device::Cpu) && m.runs_on(Device::Cuda));
    }
}
