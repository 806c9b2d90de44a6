//! Bad usage of the command line: every case exits 2 with a message that names the
//! problem, before anything runs (no fabric or root needed).

use std::process::Command;

fn usage_error(args: &[&str], needle: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
}

#[test]
fn bench_options_are_checked_before_anything_runs() {
    for (args, needle) in [
        (vec!["bench", "--iters", "0"], "--iters"),
        (vec!["bench", "--dtype", "f16"], "unknown type \"f16\""),
        (
            vec!["bench", "--redop", "prod"],
            "unknown reduction \"prod\"",
        ),
        (
            vec!["bench", "--algo", "fast"],
            "unknown algorithm \"fast\"",
        ),
        (vec!["bench", "--sizes", "0"], "must be above 0"),
        (vec!["bench", "--sizes", "64:8"], "goes downward"),
        (vec!["bench", "--sizes", "1X"], "invalid size"),
        (vec!["bench", "--channels", "0"], "--channels"),
        (vec!["bench", "--timeout", "0"], "must be above 0"),
        (vec!["bench", "--timeout", "-3"], "--timeout"),
        (vec!["bench", "--timeout", "0m"], "must be above 0"),
        (
            vec!["bench", "--timeout", "10min"],
            "\"10min\" is not a time: seconds, or with a suffix",
        ),
    ] {
        usage_error(&args, needle);
    }
}

/// A model smaller than the default bucket takes a bucket of its size: `train --model 1M`
/// goes on to look for its fabric (it was refused for the default 4 MiB bucket).
#[test]
fn train_buckets_default_to_at_most_the_model() {
    let out = Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(["train", "--fabric", "cu-none", "--model", "1M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("fabric cu-none is not up"), "{err}");
}

#[test]
fn train_and_run_options_are_checked_before_anything_runs() {
    for (args, needle) in [
        (vec!["train", "--steps", "0"], "--steps"),
        // A scenario's time 0 is for a scenario, and one of three words.
        (
            vec!["run", "--chaos-start", "now", "--", "true"],
            "--chaos <FILE>",
        ),
        (
            vec![
                "bench",
                "allreduce",
                "--chaos",
                "c.toml",
                "--chaos-start",
                "soon",
            ],
            "\"soon\": now, first-packet",
        ),
        (
            vec!["chaos", "c.toml", "--start", "later"],
            "\"later\": now, first-packet",
        ),
        (vec!["train", "--bucket", "3"], "multiples of 4 bytes"),
        (
            vec!["train", "--model", "1M", "--bucket", "16M"],
            "larger than --model",
        ),
        (vec!["train", "--model", "1M,2M"], "takes one size"),
        (vec!["train", "--compute-ms", "-1"], "must not be negative"),
        (vec!["train", "--flops", "1e12"], "--gpu-tflops"),
        // Compute per step beyond any Duration (the agents panicked on it).
        (
            vec!["train", "--compute-ms", "1e300"],
            "--compute-ms: 1e300 ms of compute per step; at most 3600000 ms",
        ),
        (
            vec!["train", "--flops", "1e12", "--gpu-tflops", "1e-300"],
            "--flops / --gpu-tflops",
        ),
        (
            vec!["run", "--timeout", "0", "--", "true"],
            "must be above 0",
        ),
        (
            vec!["run", "--master-port", "0", "--", "true"],
            "--master-port",
        ),
        (vec!["plan", "--topology", "fat-tree"], "--gpus"),
        (
            vec!["plan", "x.toml", "--radix", "8"],
            "cannot be used with",
        ),
        // A mistyped option before the command is not taken for the command.
        (
            vec!["run", "--gpu", "0", "true"],
            "unexpected argument '--gpu'",
        ),
        (vec!["exec", "gpu0"], "<CMD>"),
        // One fabric, named once: as an argument or with -f.
        (vec!["top", "ab", "-f", "cd"], "cannot be used with"),
        (vec!["status", "ab", "-f", "cd"], "cannot be used with"),
        (vec!["down", "-f", "ab", "--all"], "cannot be used with"),
        (vec!["events", "Bad_Name"], "fabric name \"Bad_Name\""),
        (
            vec!["link", "set", "leaf0", "spine0", "--loss", "5%"],
            "a probability in [0, 1] such as 0.001",
        ),
        (
            vec!["link", "set", "leaf0", "spine0", "--loss", "-0.5"],
            "'-0.5' for '--loss <LOSS>': out of range",
        ),
        (
            vec!["link", "set", "leaf0", "spine0", "--loss", "1.01"],
            "'1.01' for '--loss <LOSS>': out of range",
        ),
        (
            vec!["link", "set", "leaf0", "spine0", "--loss-burst", "0.5"],
            "'0.5' for '--loss-burst <LOSS_BURST>': a mean run of lost frames from 1 to",
        ),
        (
            vec!["capture", "--all", "-w", "x.pcap", "--count", "0"],
            "'0' for '--count <COUNT>': must be at least 1",
        ),
        // A negative value reaches its parser (clap alone reads `-1us` as options).
        (
            vec!["link", "set", "leaf0", "spine0", "--delay", "-1us"],
            "invalid duration \"-1us\": must not be negative",
        ),
        (
            vec!["load", "gpu0", "gpu1", "--rate", "-5Gbit"],
            "invalid rate \"-5Gbit\": must not be negative",
        ),
        // ... while a forgotten value is still one.
        (
            vec!["link", "set", "leaf0", "spine0", "--rate", "--delay", "1us"],
            "a value is required for '--rate <RATE>'",
        ),
    ] {
        usage_error(&args, needle);
    }
}

/// Every command that acts on one fabric takes it with `-f` (a script written for one
/// command works for the next): none of these is a usage error, each says the fabric is
/// not up.
#[test]
fn every_fabric_command_takes_f() {
    const NAME: &str = "cb-nosuch";
    for args in [
        vec!["status", "-f", NAME],
        vec!["down", "-f", NAME],
        vec!["events", "-f", NAME],
        vec!["flows", "-f", NAME],
        vec!["top", "--once", "-f", NAME],
        vec!["exec", "-f", NAME, "gpu0", "true"],
        vec!["run", "-f", NAME, "--", "true"],
        // (and a timeout as `timeout(1)` takes it)
        vec!["run", "-f", NAME, "--timeout", "1.5m", "--", "true"],
        vec!["mpirun", "-f", NAME, "--timeout", "2h", "--", "true"],
        vec!["run", "-f", NAME, "--timeout", "500ms", "--", "true"],
        vec!["link", "down", "leaf0", "spine0", "-f", NAME],
        vec!["switch", "down", "spine0", "-f", NAME],
        vec!["heal", "-f", NAME],
        vec!["events", "--fabric", NAME],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_closbox"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let said = format!("{err}{}", String::from_utf8_lossy(&out.stdout));
        assert_ne!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(said.contains("not up"), "{args:?}: {said}");
    }
}

#[test]
fn a_plot_of_no_port_is_refused() {
    usage_error(
        &["plot", "q.csv", "-o", "q.svg", "--top", "0"],
        "0 is not in 1..=1000",
    );
}
