//! Compiles `bpf/dctcp.bpf.c`, the GPUs' DCTCP for kernels without one, into the daemon
//! (`src/bpf.rs` embeds it) when clang is there. Without clang the daemon is built without
//! it and says so to a fabric that asks for `tcp_congestion = "dctcp"`; a clang that fails
//! on the program fails the build (a broken program must not pass for a missing tool).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=bpf/dctcp.bpf.c");
    println!("cargo::rerun-if-env-changed=CLANG");
    println!("cargo::rustc-check-cfg=cfg(closbox_bpf)");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let obj = out.join("dctcp.bpf.o");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    // Built again when clang appears or changes: a path that does not exist makes cargo
    // run this script at every build, so installing clang later (`make test` does, after
    // `make lint` built without it) is noticed.
    let found = if clang.contains('/') {
        Some(PathBuf::from(&clang))
    } else {
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(&clang))
                .find(|c| c.is_file())
        })
    };
    let watch = found.unwrap_or_else(|| PathBuf::from("/usr/bin").join(&clang));
    println!("cargo::rerun-if-changed={}", watch.display());
    let run = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror", "-c"])
        .arg("bpf/dctcp.bpf.c")
        .arg("-o")
        .arg(&obj)
        .output();
    match run {
        Ok(o) if o.status.success() => println!("cargo::rustc-cfg=closbox_bpf"),
        // A clang built without the BPF back end is a missing tool, not a broken program.
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("No available targets") => println!(
            "cargo::warning={clang} has no BPF target: built without closbox's DCTCP for the GPUs (`tcp_congestion = \"dctcp\"` needs it on kernels without their own)"
        ),
        Ok(o) => panic!(
            "{clang} failed on bpf/dctcp.bpf.c ({}):\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => println!(
            "cargo::warning=no {clang} ({e}): built without closbox's DCTCP for the GPUs (`tcp_congestion = \"dctcp\"` needs it on kernels without their own; install clang and rebuild)"
        ),
    }
}
