//! Hostile topology files: size bombs, special files, values that would wrap or mislead.
//! `closbox plan` must refuse each with a positioned error, without panicking, hanging or
//! allocating much (peak RSS measured per run). And hostile `closbox record` files for
//! `closbox plot`. Needs no root.
#![allow(unsafe_code)] // wait4 for the child's peak RSS

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Peak RSS the refusal of any hostile file may take.
const MAX_RSS: u64 = 100 << 20;

fn dir() -> PathBuf {
    common::test_dir("hostile")
}

struct Run {
    code: Option<i32>,
    stderr: String,
    peak_rss: u64,
    took: Duration,
}

/// Runs `closbox plan FILE`.
fn plan(file: &Path) -> Run {
    run(&["plan", file.to_str().unwrap()])
}

/// Runs closbox with `args`; a run still going after 60 s is a hang, and fails the test.
fn run(args: &[&str]) -> Run {
    let started = Instant::now();
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    loop {
        let mut status = 0;
        // SAFETY: zeroed rusage is valid; wait4 fills it for our own child.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: pid is our child; pointers are to locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
            return Run {
                code,
                stderr: reader.join().unwrap(),
                peak_rss: ru.ru_maxrss as u64 * 1024,
                took: started.elapsed(),
            };
        }
        if started.elapsed() > Duration::from_secs(60) {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("closbox {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn refused(name: &str, file: &Path, expect: &str) {
    let r = plan(file);
    eprintln!(
        "{name}: exit {:?} in {:.3} s, peak RSS {} KiB",
        r.code,
        r.took.as_secs_f64(),
        r.peak_rss >> 10
    );
    assert_eq!(r.code, Some(1), "{name}: {}", r.stderr);
    assert!(r.stderr.contains(expect), "{name}: {}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{name}: {}", r.stderr);
    assert!(
        r.peak_rss < MAX_RSS,
        "{name}: peak RSS {} bytes",
        r.peak_rss
    );
}

fn write(name: &str, text: &str) -> PathBuf {
    let p = dir().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const HEAD: &str = "[fabric]\nname = \"bomb\"\n";

#[test]
fn size_bombs_are_refused_from_their_declared_numbers() {
    for (name, body, expect) in [
        (
            "leaf-spine product wraps u32",
            "[topology]\nkind = \"leaf-spine\"\nleaves = 65536\nspines = 4\ngpus_per_leaf = 65536\n",
            ":3:1: this leaf-spine topology has 4294967296 GPUs; closbox models at most 65536",
        ),
        (
            "GPUs per leaf beyond any fabric",
            "[topology]\nkind = \"leaf-spine\"\nleaves = 4096\nspines = 4\ngpus_per_leaf = 1048576\n",
            ":7:17: `gpus_per_leaf` = 1048576: closbox models at most 65536 GPUs",
        ),
        (
            "single switch of 2^30",
            "[topology]\nkind = \"single-switch\"\ngpus = 1073741824\n",
            ":5:8: `gpus` = 1073741824: closbox models at most 65536 GPUs",
        ),
        (
            "a million GPUs",
            "[topology]\nkind = \"single-switch\"\ngpus = 1000000\n",
            ":5:8: `gpus` = 1000000: closbox models at most 65536 GPUs",
        ),
        (
            "rail-optimized 67 M",
            "[topology]\nkind = \"rail-optimized\"\nnodes = 65536\nspines = 4\n[node]\ngpus_per_node = 1024\n",
            ":3:1: this rail-optimized topology has 67108864 GPUs",
        ),
        (
            "fat-tree k = 256",
            "[topology]\nkind = \"fat-tree\"\nk = 256\n",
            ":5:5: fat-tree k = 256 has 4194304 GPUs; closbox models at most 65536 (k ≤ 64)",
        ),
        (
            "full mesh of 4096",
            "[topology]\nkind = \"full-mesh\"\ngpus = 4096\n",
            ":3:1: full-mesh is limited to 2048 GPUs",
        ),
    ] {
        refused(name, &write("bomb.toml", &format!("{HEAD}{body}")), expect);
    }
    // 1 MB declaring 25.6 M links.
    let mut text = format!(
        "{HEAD}[topology]\nkind = \"custom\"\n[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\n[[switch]]\nname = \"s\"\ntier = \"leaf\"\n"
    );
    for _ in 0..25_000 {
        text += "[[link]]\na = \"a\"\nb = \"s\"\ncount = 1024\n";
    }
    refused(
        "25.6 M links",
        &write("links.toml", &text),
        ":3:1: this custom topology has 25600000 links; closbox models at most",
    );
    // Over the byte limit.
    let big = format!("{HEAD}# {}\n", "x".repeat(2 << 20));
    refused(
        "2 MiB file",
        &write("big.toml", &big),
        "too large for a topology file",
    );
}

#[test]
fn special_files_are_refused_without_reading() {
    let fifo = dir().join("fifo.toml");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for (name, path) in [
        ("FIFO", fifo.as_path()),
        ("/dev/zero", Path::new("/dev/zero")),
        ("directory", Path::new("/tmp")),
    ] {
        refused(name, path, "not a regular file");
    }
    // (It read "-: cannot read: No such file or directory".)
    refused(
        "standard input",
        Path::new("-"),
        "standard input is not read",
    );
    refused("binary", &write("bin.toml", "\u{0}\u{1}"), "");
    let mut bytes = HEAD.as_bytes().to_vec();
    bytes.extend([0xff, 0xfe]);
    let p = dir().join("latin.toml");
    std::fs::write(&p, bytes).unwrap();
    refused("not UTF-8", &p, "not UTF-8 text");
}

#[test]
fn accepted_but_wrong_values_are_refused_with_positions() {
    let ss = "[topology]\nkind = \"single-switch\"\ngpus = 2\n";
    for (name, text, expect) in [
        (
            "GPU transit",
            format!("{HEAD}[topology]\nkind = \"custom\"\n[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\n[[host]]\nname = \"c\"\n[[switch]]\nname = \"s\"\ntier = \"leaf\"\n[[link]]\na = \"a\"\nb = \"s\"\n[[link]]\na = \"b\"\nb = \"s\"\n[[link]]\na = \"c\"\nb = \"b\"\n"),
            ":9:1: host \"c\" cannot reach host \"a\"",
        ),
        (
            "host named ..",
            format!("{HEAD}[topology]\nkind = \"custom\"\n[[host]]\nname = \"..\"\n"),
            ":6:8: name \"..\" must be",
        ),
        (
            "host named .",
            format!("{HEAD}[topology]\nkind = \"custom\"\n[[host]]\nname = \".\"\n"),
            ":6:8: name \".\" must be",
        ),
        (
            "loopback pool",
            format!("[fabric]\nname = \"bomb\"\naddress_pool = \"127.0.0.0/8\"\n{ss}"),
            ":3:16: address pool 127.0.0.0/8 overlaps the loopback",
        ),
        (
            "multicast pool",
            format!("[fabric]\nname = \"bomb\"\naddress_pool = \"239.1.0.0/16\"\n{ss}"),
            ":3:16: address pool 239.1.0.0/16 overlaps the multicast",
        ),
        (
            "reserved pool",
            format!("[fabric]\nname = \"bomb\"\naddress_pool = \"250.0.0.0/8\"\n{ss}"),
            ":3:16: address pool 250.0.0.0/8 overlaps the reserved",
        ),
        (
            "empty ecn table",
            format!("{HEAD}{ss}[switches.leaf.ecn]\n"),
            ":6:1: ecn: give either `k`",
        ),
        (
            "delay of 2^62 ns",
            format!("{HEAD}{ss}[links.nic]\ndelay = \"4611686018427387904ns\"\n"),
            ":7:9: `delay` = 4611686018427387904ns is longer than the 1s closbox allows",
        ),
        (
            "latency of a year",
            format!("{HEAD}{ss}[switches.leaf]\nlatency = \"31536000s\"\n"),
            ":7:11: `latency` = 31536000s is longer",
        ),
        (
            "fabric name that is a path",
            "[fabric]\nname = \"../x\"\n[topology]\nkind = \"single-switch\"\ngpus = 2\n".to_owned(),
            ":2:8: fabric name \"../x\" must be",
        ),
        (
            "spine-core links on a single switch",
            format!("{HEAD}{ss}[links.spine-core]\ndelay = \"1us\"\n"),
            ":7:9: [links.spine-core] does not apply",
        ),
        (
            "scale-up settings without nodes",
            format!("{HEAD}{ss}[node]\nlatency = \"1us\"\n"),
            ":7:11: [node] settings other than `gpus_per_node` apply",
        ),
        (
            "a buffer smaller than one packet",
            format!("{HEAD}{ss}[nic]\nbuffer = \"1B\"\n"),
            ":7:10: `buffer` = 1B cannot hold one packet",
        ),
        (
            "ECN threshold at the buffer",
            format!("{HEAD}{ss}[switches.leaf]\nbuffer = \"100KiB\"\necn = {{ k = \"100KiB\" }}\n"),
            ":8:7: ecn: marking starts at 100KiB, not below the buffer",
        ),
        (
            "a congestion control that does not exist",
            format!("{HEAD}{ss}[nic]\ntcp_congestion = \"nonsense\"\n"),
            ":7:18: `tcp_congestion` = \"nonsense\" is not one this host lets",
        ),
        (
            "Rust types in messages",
            format!("{HEAD}{ss}[links.nic]\nloss = \"x\"\n"),
            ":7:8: invalid type: string \"x\", expected a number",
        ),
        (
            "tiny packet memory",
            format!("[fabric]\nname = \"bomb\"\npacket_memory = \"1KiB\"\n{ss}"),
            ":3:17: `packet_memory` must be between 16MiB and 16GiB",
        ),
    ] {
        refused(name, &write("wrong.toml", &text), expect);
    }
}

/// `closbox plot` of a recording whose numbers no recording holds (not a number, infinite,
/// beyond f64, negative): refused with the file's line, not drawn (an infinite or NaN time
/// hung the axis code; a NaN value drew "NaN" into the SVG).
#[test]
fn plot_refuses_numbers_no_recording_holds() {
    let out = dir().join("plot.svg");
    let good = "# closbox record: fabric x, 1 ports, every 1ms of fabric time (time_scale 1)\n\
                fabric_time_s,port,queue_bytes,utilization\n\
                0.001,sw0->gpu0,1500,0.5\n";
    let file = write("good.csv", &format!("{good}0.002,sw0->gpu0,3000,1.0\n"));
    let r = run(&["plot", file.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for value in ["nan", "NaN", "inf", "-inf", "1e309", "-1", "-0.5"] {
        for (field, row) in [
            ("fabric_time_s", format!("{value},sw0->gpu0,3000,1.0")),
            ("queue_bytes", format!("0.002,sw0->gpu0,{value},1.0")),
            ("utilization", format!("0.002,sw0->gpu0,3000,{value}")),
        ] {
            let file = write("hostile.csv", &format!("{good}{row}\n"));
            let r = run(&["plot", file.to_str().unwrap(), "-o", out.to_str().unwrap()]);
            assert_eq!(r.code, Some(2), "{row}: {}", r.stderr);
            let at = format!("{}:4: {field} \"{value}\"", file.display());
            assert!(r.stderr.contains(&at), "{row}: {}", r.stderr);
        }
    }
}

/// `closbox plot` of what is no recording at all: a device that never ends a line (it read
/// `/dev/zero` until the kernel killed it), bytes that are not text, a file with a Windows
/// line end (read as the same rows). Refused by line, or read, in bounded memory.
#[test]
fn plot_reads_by_line_in_bounded_memory() {
    let out = dir().join("plot.svg");
    let r = run(&["plot", "/dev/zero", "-o", out.to_str().unwrap()]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(
        r.stderr.contains("/dev/zero:1: a line longer than"),
        "{}",
        r.stderr
    );
    let binary = dir().join("binary.csv");
    std::fs::write(
        &binary,
        b"fabric_time_s,port,queue_bytes,utilization\n\xff\xfe,\x00\n",
    )
    .unwrap();
    let r = run(&[
        "plot",
        binary.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("binary.csv:2: not text"), "{}", r.stderr);
    let crlf = write(
        "crlf.csv",
        "fabric_time_s,port,queue_bytes,utilization\r\n0.001,sw0->gpu0,1500,0.5\r\n",
    );
    let r = run(&["plot", crlf.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}
