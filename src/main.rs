//! `closbox`: the command line. Parses arguments, calls into the fabric crate, prints.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use closbox_switchd::control::ChangeRequest;
use closbox_switchd::state::FabricName;

mod bench;
mod capture;
mod chaos;
mod cli;
mod flows;
mod jobs;
mod live;
mod mpirun;
mod plan;
mod reap;
mod record;
mod render;
mod run;
mod status;
mod top;

use cli::{
    join_negative_values, BenchOpts, Cli, Command, LinkArgs, LinkCmd, PlanArgs, TargetArgs, UpDown,
    MAX_COMPUTE_MS,
};

/// `train --bucket` when not given (or `--model`, if that is smaller).
const DEFAULT_BUCKET: usize = 4 << 20;

/// A usage error found after parsing (bad combinations, values checked against the
/// fabric): exit 2, as clap's own.
#[derive(Debug)]
pub(crate) struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

pub(crate) fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(msg.into()))
}

/// A program `exec` or `run` could not start: exit 127 when it was not found, 126 when it
/// was found but could not be run (as POSIX shells, `env` and `timeout` exit), so that a
/// caller that passes exit codes through (an MPI launcher's remote shell) sees which.
#[derive(Debug)]
pub(crate) struct CannotRun {
    pub code: u8,
    pub message: String,
}

impl std::fmt::Display for CannotRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CannotRun {}

/// A job stopped by Ctrl-C or SIGTERM, said where it stopped: exit 130, as shells report
/// a command ended by SIGINT.
#[derive(Debug)]
pub(crate) struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

fn run_bench(ops: Vec<String>, target: &TargetArgs, o: BenchOpts) -> anyhow::Result<()> {
    let ops = if ops.is_empty() {
        vec!["allreduce".to_owned()]
    } else {
        ops
    };
    let ops = closbox_agents::bench::parse_ops(&ops).map_err(|e| usage(e.to_string()))?;
    if let Some(p) = &o.plot {
        bench::check_plot_path(p)?;
    }
    bench::bench(bench::BenchArgs {
        target: target.target(),
        ops,
        opts: o.agent,
        json: o.json,
        csv: o.csv,
        plot: o.plot,
    })
}

/// `closbox switch|gpu down|up|flap`: every link of a switch, or of a GPU.
fn up_down(cmd: UpDown, gpu: bool) -> anyhow::Result<ExitCode> {
    let (fabric, req) = match cmd {
        UpDown::Down { name, fabric } if gpu => (fabric, ChangeRequest::GpuDown { name }),
        UpDown::Down { name, fabric } => (fabric, ChangeRequest::SwitchDown { name }),
        UpDown::Up { name, fabric } if gpu => (fabric, ChangeRequest::GpuUp { name }),
        UpDown::Up { name, fabric } => (fabric, ChangeRequest::SwitchUp { name }),
        UpDown::Flap { name, flap, fabric } => (
            fabric,
            ChangeRequest::SwitchFlap {
                name,
                gpu,
                down_ns: flap.down.as_nanos(),
                up_ns: flap.up.as_nanos(),
                count: flap.count,
            },
        ),
    };
    chaos::change(fabric.as_ref(), req)
}

fn main() -> ExitCode {
    live::undilate_self();
    closbox_switchd::sys::default_sigpipe();
    let cli = {
        use clap::CommandFactory;
        let cmd = Cli::command();
        Cli::parse_from(join_negative_values(&cmd, std::env::args_os().collect()))
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLOSBOX_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Plan(args) => run_plan(args).map(|()| ExitCode::SUCCESS),
        Command::Up(args) => live::up(args)
        .map(|()| ExitCode::SUCCESS),
        Command::Down {
            fabric,
            fabric_flag,
            all,
        } => live::down(
            &fabric.into_iter().chain(fabric_flag).collect::<Vec<_>>(),
            all,
        )
        .map(|()| ExitCode::SUCCESS),
        Command::Status {
            fabric,
            fabric_flag,
            json,
            ports,
        } => status::status(fabric.or(fabric_flag).as_ref(), json, ports.as_deref()),
        Command::Link(cmd) => {
            // The link(s) a command names, as the request's three fields.
            let named = |l: &LinkArgs| (l.a.clone(), l.b.clone(), l.index);
            let (l, req) = match cmd {
                LinkCmd::Down(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkDown { a, b, index })
                }
                LinkCmd::Up(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkUp { a, b, index })
                }
                LinkCmd::Reset(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkReset { a, b, index })
                }
                LinkCmd::Flap { link: l, flap } => {
                    let (a, b, index) = named(&l);
                    let r = ChangeRequest::LinkFlap {
                        a,
                        b,
                        index,
                        down_ns: flap.down.as_nanos(),
                        up_ns: flap.up.as_nanos(),
                        count: flap.count,
                    };
                    (l, r)
                }
                LinkCmd::Set {
                    link: l,
                    rate,
                    delay,
                    loss,
                    loss_burst,
                    from,
                    buffer,
                } => {
                    let (a, b, index) = named(&l);
                    let r = ChangeRequest::LinkSet {
                        a,
                        b,
                        index,
                        rate_bps: rate.map(|r| r.bps()),
                        delay_ns: delay.map(|d| d.as_nanos()),
                        loss,
                        loss_burst,
                        buffer_bytes: buffer.map(|b| b.get()),
                        from,
                    };
                    (l, r)
                }
            };
            chaos::change(l.fabric.as_ref(), req)
        }
        Command::Switch(cmd) => up_down(cmd, false),
        Command::Gpu(cmd) => up_down(cmd, true),
        Command::Events {
            fabric,
            json,
            follow,
        } => chaos::events(fabric.get(), json, follow),
        Command::Load {
            from,
            to,
            rate,
            duration,
            on,
            off,
            packet,
            stop,
            fabric,
        } => (|| {
            let req = match stop {
                Some(id) => ChangeRequest::LoadStop { id },
                None => ChangeRequest::Load {
                    from: from.expect("clap requires it"),
                    to: to.expect("clap requires it"),
                    rate_bps: rate.expect("clap requires it").bps(),
                    packet_bytes: match packet {
                        Some(p) => Some(u32::try_from(p.get()).map_err(|_| {
                            usage("--packet must be at most the fabric's mtu")
                        })?),
                        None => None,
                    },
                    for_ns: duration.map(|d| d.as_nanos()),
                    on_ns: on.map(|d| d.as_nanos()),
                    off_ns: off.map(|d| d.as_nanos()),
                },
            };
            chaos::load(fabric.as_ref(), req)
        })(),
        Command::Incast {
            gpu,
            from,
            bytes,
            every,
            count,
            fabric,
        } => chaos::incast(
            fabric.as_ref(),
            gpu,
            &from,
            bytes.get(),
            every.map(|d| d.as_nanos()),
            count,
        ),
        Command::Capture {
            ports,
            links,
            gpus,
            all,
            file,
            count,
            duration,
            snaplen,
            drops,
            fabric,
        } => capture::capture(capture::Args {
            fabric: fabric.get(),
            select: capture::Selection {
                ports: &ports,
                links: &links,
                gpus: &gpus,
                all,
            },
            file: &file,
            count,
            duration_ns: duration.map(|d| d.as_nanos()),
            snaplen,
            drops,
        }),
        Command::Flows {
            top,
            since,
            json,
            fabric,
        } => flows::flows(fabric.get(), top, since, json),
        Command::Record {
            file,
            interval,
            ports,
            duration,
            fabric,
        } => record::record(record::RecordArgs {
            fabric: fabric.get(),
            file: &file,
            interval,
            ports: ports.as_deref(),
            duration,
        }),
        Command::Plot {
            file,
            out,
            metric,
            top,
        } => record::plot(&file, &out, metric, top),
        Command::Top { once, fabric } => top::top(fabric.get(), once),
        Command::Mpirun {
            fabric,
            gpus,
            np,
            timeout,
            implementation,
            mca,
            export,
            dry_run,
            chaos,
            chaos_start,
            fabric_clock,
            cmd,
        } => mpirun::mpirun(mpirun::MpirunArgs {
            fabric: fabric.as_ref(),
            gpus: &gpus,
            np,
            timeout,
            implementation,
            mca: &mca,
            export: &export,
            dry_run,
            chaos: chaos.as_deref(),
            chaos_start,
            fabric_clock,
            cmd: &cmd,
        }),
        Command::Rsh {
            fabric,
            cpu_map,
            host,
            cmd,
        } => rsh(fabric.as_ref(), cpu_map.as_deref(), &host, &cmd),
        Command::Reap {
            fabric,
            job,
            command,
        } => reap::reap(&fabric, job, &command),
        Command::Chaos {
            file,
            dry_run,
            topology,
            detach,
            json,
            gpus,
            start,
            fabric,
        } => chaos::scenario_cmd(chaos::ScenarioArgs {
            fabric: fabric.as_ref(),
            file: &file,
            dry_run,
            topology: topology.as_deref(),
            detach,
            json,
            gpus: gpus.as_deref(),
            start,
        }),
        Command::Partition { groups, fabric } => chaos::partition(fabric.as_ref(), &groups),
        Command::Heal { fabric } => chaos::change(fabric.get(), ChangeRequest::Heal),
        Command::Reset { fabric } => chaos::change(fabric.get(), ChangeRequest::Reset),
        Command::Cancel { timeline, fabric } => chaos::cancel(fabric.as_ref(), timeline),
        Command::Exec {
            gpu,
            fabric,
            die_with_parent,
            fabric_clock,
            timeout,
            cmd,
        } => live::exec(
            fabric.as_ref(),
            &gpu,
            &cmd,
            live::ExecOptions {
                die_with_parent,
                fabric_clock,
                timeout,
            },
        ),
        Command::Bench { ops, target, opts } => {
            run_bench(ops, &target, opts).map(|()| ExitCode::SUCCESS)
        }
        Command::Train {
            target,
            model,
            bucket,
            compute_ms,
            flops,
            gpu_tflops,
            steps,
            algo,
            json,
        } => (|| {
            let compute_ms = match (compute_ms, flops, gpu_tflops) {
                (Some(ms), _, _) => Some(ms),
                (None, Some(f), Some(t)) => Some(f / (t * 1e12) * 1e3),
                _ => None,
            };
            if let Some(ms) = compute_ms.filter(|&ms| ms.is_nan() || ms > MAX_COMPUTE_MS) {
                let given = if flops.is_some() {
                    "--flops / --gpu-tflops"
                } else {
                    "--compute-ms"
                };
                return Err(usage(format!(
                    "{given}: {ms:e} ms of compute per step; at most {MAX_COMPUTE_MS} ms (one hour of fabric time)"
                )));
            }
            // The default bucket is no larger than the model (`--model 1M` alone was refused
            // for the default's 4 MiB).
            let bucket = bucket.unwrap_or(DEFAULT_BUCKET.min(model));
            if model % 4 != 0 || bucket % 4 != 0 {
                return Err(usage(
                    "--model and --bucket must be whole numbers of f32 elements (multiples of 4 bytes)",
                ));
            }
            if bucket > model {
                return Err(usage(format!(
                    "--bucket ({bucket} bytes) is larger than --model ({model} bytes)"
                )));
            }
            bench::train(bench::TrainArgs {
                target: target.target(),
                model_bytes: model,
                bucket_bytes: bucket,
                compute_ms,
                steps: steps as usize,
                algo,
                json,
            })
        })()
        .map(|()| ExitCode::SUCCESS),
        Command::Run {
            fabric,
            gpus,
            timeout,
            master_port,
            chaos,
            chaos_start,
            fabric_clock,
            cmd,
        } => (|| {
            closbox_switchd::require_root("closbox run")?;
            let st = live::resolve(fabric.as_ref())?;
            let sel = live::select(&st, &gpus)?;
            if fabric_clock {
                live::enable_fabric_clock(&st)?;
            }
            let timeline = chaos
                .as_deref()
                .map(|f| chaos::Timeline::load(&st, f, chaos_start))
                .transpose()?
                .map(|mut t| {
                    t.live = true;
                    t.gpus = sel.iter().map(|&i| st.gpus[i].name.clone()).collect();
                    t
                });
            let mut job = jobs::Job::begin(&st, &sel, "run");
            let code = run::run(run::RunArgs {
                st: &st,
                sel: &sel,
                timeout,
                master_port,
                cmd: &cmd,
                sink: None,
                chaos: timeline.as_ref(),
            })?;
            jobs::say_shared(&st, &mut job);
            Ok(code)
        })(),
    };
    match result {
        Ok(code) => code,
        // (A job stopped by a signal has said so, with what it stopped.)
        Err(e) if e.downcast_ref::<Interrupted>().is_some() => ExitCode::from(130),
        Err(e) => {
            eprintln!("closbox: {e:#}");
            if e.downcast_ref::<Usage>().is_some() {
                ExitCode::from(2)
            } else if let Some(c) = e.downcast_ref::<CannotRun>() {
                ExitCode::from(c.code)
            } else if e.downcast_ref::<closbox_switchd::NameTaken>().is_some() {
                ExitCode::from(closbox_switchd::NameTaken::EXIT)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run_plan(args: PlanArgs) -> anyhow::Result<()> {
    let out = match (&args.file, args.gpus, args.topology) {
        (Some(file), _, _) => {
            let topo = closbox_fabric::load(file)?;
            let p = closbox_fabric::plan::Plan::of(&topo);
            if args.json {
                serde_json::to_string_pretty(&p)?
            } else {
                plan::render_plan(&p)
            }
        }
        (None, Some(gpus), Some(kind)) => {
            let s = closbox_fabric::plan::Sizing::new(gpus, args.radix.unwrap_or(64));
            if args.json {
                serde_json::to_string_pretty(&s)?
            } else {
                plan::render_sizing(&s, kind)
            }
        }
        _ => unreachable!("clap requires a file or --gpus with --topology"),
    };
    println!("{out}");
    Ok(())
}

/// `host`'s CPU in a `--cpu-map` (`gpu0=0,gpu15=1`); an error if it is malformed or lacks
/// the host.
fn cpu_of(map: &str, host: &str) -> anyhow::Result<usize> {
    for pair in map.split(',') {
        let (h, c) = pair
            .split_once('=')
            .with_context(|| format!("--cpu-map: {pair:?} is not HOST=CPU"))?;
        if h == host {
            return c
                .parse()
                .with_context(|| format!("--cpu-map: {c:?} is not a CPU number"));
        }
    }
    anyhow::bail!("--cpu-map {map:?} has no CPU for {host}")
}

/// `closbox rsh`: `cmd` (words of one shell line, as ssh would run it) in GPU `host`,
/// ended with its launcher; on its CPU if `cpu_map` lists one for `host`.
fn rsh(
    fabric: Option<&FabricName>,
    cpu_map: Option<&str>,
    host: &str,
    cmd: &[String],
) -> anyhow::Result<ExitCode> {
    if let Some(cpu) = cpu_map.map(|m| cpu_of(m, host)).transpose()? {
        closbox_switchd::sys::pin_to_cpu(cpu)
            .with_context(|| format!("pinning {host}'s command to CPU {cpu}"))?;
    }
    let line = format!("exec {}", cmd.join(" "));
    live::exec(
        fabric,
        host,
        &["sh".to_owned(), "-c".to_owned(), line],
        live::ExecOptions {
            die_with_parent: true,
            ..Default::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::cpu_of;

    #[test]
    fn cpu_map_gives_the_hosts_cpu_or_names_the_problem() {
        assert_eq!(cpu_of("gpu0=0,gpu15=1", "gpu15").unwrap(), 1);
        assert_eq!(cpu_of("gpu0=0,gpu15=1", "gpu0").unwrap(), 0);
        let e = cpu_of("gpu0=0", "gpu1").unwrap_err().to_string();
        assert!(e.contains("no CPU for gpu1"), "{e}");
        let e = cpu_of("gpu0:0", "gpu0").unwrap_err().to_string();
        assert!(e.contains("is not HOST=CPU"), "{e}");
        let e = cpu_of("gpu0=x", "gpu0").unwrap_err().to_string();
        assert!(e.contains("\"x\" is not a CPU number"), "{e}");
    }

    /// `--help` says what every argument of every command is for (hidden ones aside).
    #[test]
    fn every_argument_has_help() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            if cmd.is_hide_set() {
                return;
            }
            let path = format!("{path} {}", cmd.get_name());
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if !builtin && !a.is_hide_set() && a.get_help().is_none() {
                    missing.push(format!("{path} {}", a.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &path, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&crate::Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no help for: {missing:?}");
    }

    #[test]
    fn negative_values_are_joined_to_their_option_and_programs_args_left_alone() {
        use clap::CommandFactory;
        let cmd = crate::Cli::command();
        let join = |args: &[&str]| -> Vec<String> {
            crate::join_negative_values(&cmd, args.iter().map(|a| (*a).into()).collect())
                .into_iter()
                .map(|a| a.into_string().unwrap())
                .collect()
        };
        assert_eq!(
            join(&["closbox", "link", "set", "a", "b", "--delay", "-1us", "--rate", "-.5G"]),
            [
                "closbox",
                "link",
                "set",
                "a",
                "b",
                "--delay=-1us",
                "--rate=-.5G"
            ]
        );
        // Not a value: a flag, or an option that is not a number.
        for args in [
            &["closbox", "up", "x.toml", "--detach", "-5"][..],
            &[
                "closbox", "link", "set", "a", "b", "--rate", "--delay", "1us",
            ],
            // A program's arguments: after exec's GPU, after `--`.
            &["closbox", "exec", "gpu0", "tool", "--delay", "-1"],
            &["closbox", "run", "--", "tool", "--delay", "-1"],
            &["closbox", "mpirun", "-n", "2", "prog", "--delay", "-1"],
        ] {
            assert_eq!(join(args), args, "{args:?}");
        }
    }

    #[test]
    fn mpirun_takes_np_as_mpirun_does_and_leaves_the_programs_alone() {
        use clap::{CommandFactory, Parser};
        let cmd = crate::Cli::command();
        let parse = |args: &[&str]| {
            let joined =
                crate::join_negative_values(&cmd, args.iter().map(|a| (*a).into()).collect());
            crate::Cli::try_parse_from(joined)
        };
        for args in [
            &["closbox", "mpirun", "-np", "4", "prog", "-np", "9"][..],
            &["closbox", "mpirun", "-n", "4", "--", "prog", "-np", "9"],
            &["closbox", "mpirun", "--np", "4", "prog", "-np", "9"],
            // After options with values (read as the program's first word before).
            &[
                "closbox", "mpirun", "--fabric", "ls16", "-np", "4", "prog", "-np", "9",
            ],
            &[
                "closbox", "mpirun", "-f", "ls16", "-np", "4", "prog", "-np", "9",
            ],
            &[
                "closbox", "mpirun", "--mca", "btl", "tcp", "-x", "A=1", "-np", "4", "prog", "-np",
                "9",
            ],
            &[
                "closbox",
                "mpirun",
                "--timeout",
                "5",
                "--chaos",
                "c.toml",
                "-np",
                "4",
                "prog",
                "-np",
                "9",
            ],
            &[
                "closbox",
                "mpirun",
                "--chaos",
                "c.toml",
                "--chaos-start",
                "every-gpu",
                "-np",
                "4",
                "prog",
                "-np",
                "9",
            ],
        ] {
            match parse(args).map(|c| c.command) {
                Ok(crate::Command::Mpirun { np, cmd, .. }) => {
                    assert_eq!(np, Some(4), "{args:?}");
                    assert_eq!(cmd, ["prog", "-np", "9"], "{args:?}");
                }
                other => panic!("{args:?}: {other:?}"),
            }
        }
        // Not with --gpus; and only mpirun's.
        assert!(parse(&["closbox", "mpirun", "-np", "2", "--gpus", "0,3", "prog"]).is_err());
        assert!(parse(&["closbox", "run", "-np", "2", "prog"]).is_err());
    }
}
