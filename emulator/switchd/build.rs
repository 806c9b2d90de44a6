//! Compiles `bpf/dctcp.bpf.c`, the GPUs' DCTCP for kernels without one, into the daemon
//! (`src/bpf.rs` embeds it) when clang is there. Without clang the daemon is built without
//! it and says so to a fabric that asks for `tcp_congestion = "dctcp"`; a clang that fails
//! on the program fails the build (a broken program must not pass for a missing tool).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=bpf/dctcp.bpf.c");
    println!("cargo::rerun-if-env-changed=CLANG");
    println!("cargo::rustc-check-cfg=cfg(closbox_bpf)");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let obj = out.join("dctcp.bpf.o");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    // Built again when clang appears, goes or changes. Once found, its file is watched
    // (cargo reruns this script when it is newer than the last run, or gone). Not found,
    // the directories it would be found in are watched: a package manager keeps the
    // mtime the file had when the package was built (years ago), so a watched path that
    // appears is older than the last run and cargo would not notice it; the directory it
    // appears in is changed now. So `make build` before `make test` installs clang is
    // followed by a build with it, and a box without clang does not rebuild the crate at
    // every build.
    let found = if clang.contains('/') {
        Path::new(&clang).is_file().then(|| PathBuf::from(&clang))
    } else {
        search_path()
            .into_iter()
            .map(|d| d.join(&clang))
            .find(|c| c.is_file())
    };
    match &found {
        Some(file) => println!("cargo::rerun-if-changed={}", file.display()),
        None if clang.contains('/') => {
            let dir = Path::new(&clang).parent().filter(|d| d.is_dir());
            // A path whose directory does not exist either: watched as missing (cargo
            // reruns this script at every build until it exists).
            let watch = dir.map_or_else(|| PathBuf::from(&clang), Path::to_path_buf);
            println!("cargo::rerun-if-changed={}", watch.display());
        }
        None => {
            for dir in search_path() {
                println!("cargo::rerun-if-changed={}", dir.display());
            }
        }
    }
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

/// The directories of `PATH` clang may be installed into: absolute, existing, not the
/// root (cargo walks a watched directory's whole tree to find its newest file).
fn search_path() -> Vec<PathBuf> {
    let Some(path) = std::env::var_os("PATH") else {
        return vec![PathBuf::from("/usr/bin")];
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    for d in std::env::split_paths(&path) {
        if d.is_absolute() && d.parent().is_some() && d.is_dir() && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}
