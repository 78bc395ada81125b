//! One file per subcommand; this module only dispatches.

mod bench_args;
mod bench_attention;
mod bench_collectives;
mod bench_data;
mod bench_offload;
mod bench_optimizer;
mod bench_train;
mod config_show;
mod config_validate;
mod data_info;
mod data_prepare;
mod data_train_tokenizer;
mod data_verify;
mod estimate;
mod eval;
mod generate;
mod memory_timeline;
mod offload_arg;
mod plan;
mod plugins_disable;
mod plugins_enable;
mod plugins_info;
mod plugins_keygen;
mod plugins_list;
mod plugins_sign;
mod plugins_vet;
mod progress;
mod report;
mod report_plot;
mod train;

use ava_core::PluginKind;

use crate::{
    CmdResult, Failure,
    cli::{BenchCommand, Command, ConfigCommand, DataCommand, PluginsCommand},
    output::Printer,
};

/// Runs a parsed command.
pub fn run(command: Command, p: &Printer) -> CmdResult {
    match command {
        Command::Train(args) => train::run(p, &args),
        Command::Estimate { config, world_size, rank, device } => {
            estimate::run(p, &config, world_size as usize, rank.map(|r| r as usize), device)
        }
        Command::Plan(args) => plan::run(p, &args),
        Command::Generate(args) => generate::run(p, &args),
        Command::Eval(args) => eval::run(p, &args),
        Command::Report(args) => report::run(p, &args),
        Command::Bench(BenchCommand::Train { config, steps, warmup, modes, offload, trace, memory_trace }) => {
            if modes && trace.is_some() {
                Err(crate::Failure::Usage(anyhow::anyhow!(
                    "--trace records one config's profiled steps, and --modes runs several: trace one mode at a \
                     time, e.g. ava bench train -c CONFIG --set train.precision=bf16 --trace trace.json"
                )))
            } else if modes {
                bench_train::run_modes(p, &config, steps, warmup, offload.as_deref())
            } else if offload.is_some() {
                Err(crate::Failure::Usage(anyhow::anyhow!(
                    "--offload goes with --modes (it adds the modes that stream the state through the tier); to \
                     bench one config with a tier, set plugins.offload and offload.tiers in it"
                )))
            } else {
                bench_train::run(p, &config, steps, warmup, trace.as_deref(), memory_trace)
            }
        }
        Command::Bench(BenchCommand::Attention(args)) => bench_attention::run(p, &args),
        Command::Bench(BenchCommand::Optimizer(args)) => bench_optimizer::run(p, &args),
        Command::Bench(BenchCommand::Offload(args)) => bench_offload::run(p, &args),
        Command::Bench(BenchCommand::Collectives(args)) => bench_collectives::run(p, &args),
        Command::Bench(BenchCommand::Data(args)) => bench_data::run(p, &args),
        Command::Data(c) => match c {
            DataCommand::Prepare(args) => data_prepare::run(p, &args),
            DataCommand::TrainTokenizer(args) => data_train_tokenizer::run(p, &args),
            DataCommand::Info { dir } => data_info::run(p, &dir),
            DataCommand::Verify { dir } => data_verify::run(p, &dir),
        },
        Command::Plugins(c) => match c {
            PluginsCommand::List { kind, config } => plugins_list::run(p, kind.as_deref(), &config),
            PluginsCommand::Info { name, kind, config } => plugins_info::run(p, &name, kind.as_deref(), &config),
            PluginsCommand::Vet { path_or_name, lock, config } => plugins_vet::run(p, &path_or_name, lock, &config),
            PluginsCommand::Sign { key, lock, config } => plugins_sign::run(p, &key, lock, &config),
            PluginsCommand::Keygen { out } => plugins_keygen::run(p, &out),
            PluginsCommand::Enable { kind, name, config, set } => plugins_enable::run(p, &kind, &name, config, &set),
            PluginsCommand::Disable { kind, config } => plugins_disable::run(p, &kind, config),
        },
        Command::Config(c) => match c {
            ConfigCommand::Show { config } => config_show::run(p, &config),
            ConfigCommand::Validate { file, set } => config_validate::run(p, &file, &set),
        },
    }
}

/// Parses a kind argument, with a clear error listing the kinds.
pub fn parse_kind(s: &str) -> Result<PluginKind, Failure> {
    PluginKind::parse(s).ok_or_else(|| {
        let names: Vec<&str> = PluginKind::ALL.iter().map(|k| k.as_str()).collect();
        let hint = ava_core::options::did_you_mean(s, names.iter().copied())
            .map(|n| format!(" (did you mean '{n}'?)"))
            .unwrap_or_default();
        Failure::Usage(anyhow::anyhow!("unknown plugin kind '{s}'{hint}; kinds: {}", names.join(", ")))
    })
}
