//! Live fabrics, as root: namespaces, TUNs, the real-time daemon, the CLI, real programs
//! (iperf3, sockperf, torch.distributed) and cleanup. One test at a time (`serial`):
//! fidelity figures need a quiet box.

mod common;

use std::time::{Duration, Instant};

use common::{
    closbox, closbox_ok, leaf_spine_4, leftovers, root_or_skip, scratch_dir, serial, text,
    wait_for_port, TestFabric,
};

/// `status FABRIC` once it lists `job` (or after 20 s, as it is then).
fn status_listing(fabric: &str, job: &str) -> String {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let st = text(&closbox(&["status", fabric])).0;
        if st.contains(job) || Instant::now() >= until {
            return st;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first line a child process prints (its stdout, piped, is closed after it).
fn first_line(child: &mut std::process::Child) -> String {
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    line
}

#[test]
fn lifecycle_exec_run_and_errors() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-life", &leaf_spine_4("1Gbit", "10us"));

    // Each GPU has its own hostname, address and hosts file.
    let out = f.exec("gpu1", &["hostname"]);
    assert_eq!(text(&out).0.trim(), "gpu1");
    let out = f.exec("gpu1", &["cat", "/etc/hostname"]);
    assert_eq!(text(&out).0, "gpu1\n");
    let out = f.exec("3", &["cat", "/etc/hosts"]);
    let hosts = text(&out).0;
    assert!(
        hosts.contains("198.18.0.1\tgpu0") && hosts.contains("198.18.0.4\tgpu3"),
        "{hosts}"
    );
    let out = f.exec(
        "gpu2",
        &[
            "/usr/bin/python3",
            "-c",
            "import socket; print(socket.gethostbyname(socket.gethostname()))",
        ],
    );
    assert_eq!(text(&out).0.trim(), "198.18.0.3");

    // The GPUs' TCP is the file's (Reno by default, whatever the host's default is), with
    // ECN requested and no slow-start restart after idle.
    let out = f.exec(
        "gpu1",
        &[
            "cat",
            "/proc/sys/net/ipv4/tcp_congestion_control",
            "/proc/sys/net/ipv4/tcp_ecn",
            "/proc/sys/net/ipv4/tcp_slow_start_after_idle",
        ],
    );
    assert_eq!(text(&out).0, "reno\n1\n0\n", "{:?}", text(&out));
    // Socket buffers start at their maximum (the host's maximum).
    let host = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_rmem").unwrap();
    let max = host.split_whitespace().last().unwrap().to_owned();
    let out = f.exec("gpu1", &["cat", "/proc/sys/net/ipv4/tcp_rmem"]);
    let gpu: Vec<String> = text(&out).0.split_whitespace().map(str::to_owned).collect();
    assert_eq!(gpu[1..], [max.clone(), max], "{:?}", text(&out));

    // Traffic crosses the fabric: a UDP datagram from gpu0 to gpu3.
    let echo = "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('gpu3', 7007)); d,a=s.recvfrom(100); s.sendto(d.upper(), a)";
    let mut server = f.spawn("gpu3", &["/usr/bin/python3", "-c", echo]);
    wait_for_port(&f, "gpu3", 7007);
    let client = "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5); s.sendto(b'hello', ('gpu3', 7007)); print(s.recvfrom(100)[0].decode())";
    let out = f.exec("gpu0", &["/usr/bin/python3", "-c", client]);
    assert_eq!(text(&out).0.trim(), "HELLO", "{:?}", text(&out));
    let _ = server.wait();
    let st = f.status();
    assert!(st["delivered"].as_u64().unwrap() >= 2, "{st}");
    assert_eq!(st["behind"], false);

    // Exit codes pass through; bad input gets clear errors.
    assert_eq!(
        f.exec("gpu0", &["sh", "-c", "exit 7"]).status.code(),
        Some(7)
    );
    let out = f.exec("gpu9", &["true"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a GPU outside the fabric is bad usage"
    );
    for sel in ["9", "0,0", "x", "8-9"] {
        let out = closbox(&["run", "--fabric", "lt-life", "--gpus", sel, "true"]);
        assert_eq!(out.status.code(), Some(2), "--gpus {sel}: {:?}", text(&out));
    }
    assert!(
        text(&out).1.contains("has no GPU \"gpu9\""),
        "{:?}",
        text(&out)
    );
    // A program that cannot start: 127 not found, 126 not runnable, as shells say it.
    let out = f.exec("gpu0", &["no-such-command-xyz"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out)
        .1
        .contains("command not found: no-such-command-xyz"));
    let out = f.exec("gpu0", &["/etc/hostname"]);
    assert_eq!(out.status.code(), Some(126), "{:?}", text(&out));
    assert!(text(&out).1.contains("cannot run /etc/hostname"));
    let out = closbox(&["run", "--fabric", "lt-life", "no-such-command-xyz"]);
    assert_eq!(out.status.code(), Some(127), "{:?}", text(&out));
    // Rank 0 reads `run`'s standard input (as mpirun's rank 0 does), the others nothing;
    // a rank 0 that stops reading it early does not end `run` (before: every rank read
    // /dev/null).
    let out = common::closbox_with_input(
        &[
            "run",
            "--fabric",
            "lt-life",
            "--gpus",
            "0-1",
            "--",
            "sh",
            "-c",
            "cat; echo end",
        ],
        b"one\ntwo\n",
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    let mut lines: Vec<&str> = o.lines().collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        ["[0] end", "[0] one", "[0] two", "[1] end"],
        "{o}{e}"
    );
    let out = common::closbox_with_input(
        &[
            "run", "--fabric", "lt-life", "--gpus", "0-1", "--", "head", "-c", "4",
        ],
        &b"abc\n".repeat(1 << 20),
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    assert_eq!(o, "[0] abc\n", "{e}");
    // The fabric written where `status` takes it: the error says how `run` takes it.
    let out = closbox(&["run", "lt-life", "--", "true"]);
    assert_eq!(out.status.code(), Some(127), "{:?}", text(&out));
    assert!(
        text(&out)
            .1
            .contains("`closbox run` takes its fabric with -f: `closbox run -f lt-life -- true`"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["exec", "--fabric", "lt-nope", "gpu0", "--", "true"]);
    assert!(
        text(&out).1.contains("fabric lt-nope is not up"),
        "{:?}",
        text(&out)
    );
    // The command needs no `--` before it (as `ip netns exec`); its options are its own.
    let out = closbox(&["exec", "-f", "lt-life", "gpu2", "hostname"]);
    assert_eq!(text(&out).0, "gpu2\n", "{:?}", text(&out));
    let out = closbox(&["exec", "-f", "lt-life", "gpu2", "sh", "-c", "echo $0", "-f"]);
    assert_eq!(text(&out).0, "-f\n", "{:?}", text(&out));
    // Commands with no other argument take the fabric as `status` and `down` do, or with -f.
    for args in [
        &["events", "lt-life"][..],
        &["flows", "lt-life", "--top", "1"],
        &["top", "lt-life", "--once"],
        &["top", "-f", "lt-life", "--once"],
    ] {
        let out = closbox(args);
        assert!(out.status.success(), "{args:?}: {:?}", text(&out));
        assert!(
            text(&out).0.contains("lt-life"),
            "{args:?}: {:?}",
            text(&out)
        );
    }
    let out = closbox(&["events", "lt-nope"]);
    assert!(
        text(&out).1.contains("fabric lt-nope is not up"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["up", f.config.to_str().unwrap(), "--detach"]);
    assert_eq!(out.status.code(), Some(4), "a name already up: exit 4");
    assert!(text(&out).1.contains("already up"), "{:?}", text(&out));
    // Said before anything is measured (it followed `auto`'s calibration notice), with
    // the way to have both.
    let out = closbox(&[
        "up",
        f.config.to_str().unwrap(),
        "--detach",
        "--time-scale",
        "auto",
    ]);
    assert_eq!(out.status.code(), Some(4));
    let e = text(&out).1;
    assert!(
        e.contains("already up") && e.contains("up --name") && !e.contains("measuring"),
        "{e}"
    );

    // run: one process per GPU with launcher variables, output prefixed by rank.
    let out = closbox(&[
        "run", "--fabric", "lt-life", "--", "sh", "-c",
        "echo $RANK/$WORLD_SIZE $LOCAL_RANK $NODE_RANK $MASTER_ADDR:$MASTER_PORT $GLOO_SOCKET_IFNAME $CLOSBOX_FABRIC $(hostname) {rank}",
    ]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    for r in 0..4 {
        let want = format!("[{r}] {r}/4 0 {r} gpu0:29500 cb0 lt-life gpu{r} {r}");
        assert!(o.lines().any(|l| l == want), "missing {want:?} in\n{o}");
    }
    // Two jobs on one GPU at once get rendezvous ports of their own, and a port something
    // in the first GPU listens on is passed over (both shared 29500: the second's rank 0
    // could not bind it and its other ranks joined the first's rendezvous); --master-port
    // is taken as given.
    let job = |extra: &[&str]| {
        let mut args = vec!["run", "--fabric", "lt-life", "--gpus", "0-1"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", "echo port $MASTER_PORT; sleep 1"]);
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
    };
    let port_of = |out: std::process::Output| {
        let (o, e) = text(&out);
        assert!(out.status.success(), "{o}{e}");
        let ports: Vec<&str> = o.lines().filter_map(|l| l.split("port ").nth(1)).collect();
        assert_eq!(ports.len(), 2, "{o}");
        assert_eq!(ports[0], ports[1], "{o}");
        (ports[0].to_owned(), e)
    };
    let (a, b) = (job(&[]), job(&[]));
    let (a, b) = (
        port_of(a.wait_with_output().unwrap()),
        port_of(b.wait_with_output().unwrap()),
    );
    let mut ports = [a.0.as_str(), b.0.as_str()];
    ports.sort();
    assert_eq!(ports, ["29500", "29501"], "{a:?} {b:?}");
    let said = if a.0 == "29501" { &a.1 } else { &b.1 };
    assert!(
        said.contains("MASTER_PORT 29501: 29500 is taken in gpu0"),
        "{said}"
    );
    let mut listener = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(["exec", "-f", "lt-life", "gpu0", "/usr/bin/python3", "-c"])
        .arg("import socket, time\ns = socket.create_server(('', 29500))\nprint('listening', flush=True)\ntime.sleep(30)")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut listener), "listening\n");
    assert_eq!(port_of(job(&[]).wait_with_output().unwrap()).0, "29501");
    assert_eq!(
        port_of(job(&["--master-port", "29500"]).wait_with_output().unwrap()).0,
        "29500"
    );
    let _ = listener.kill();
    let _ = listener.wait();
    // Jobs that share a fabric know of each other: `status` lists them, and each names
    // the others that ran during it, also one that began and ended within it (both
    // counted every packet of both as theirs).
    let go = scratch_dir().join("jobs-go");
    let _ = std::fs::remove_file(&go);
    let wait_for_go = format!("while [ ! -e {} ]; do sleep 0.02; done", go.display());
    let spawn = |gpus: &str, script: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
            .args(["run", "--fabric", "lt-life", "--gpus", gpus])
            .args(["--", "sh", "-c", script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let long = spawn("0-1", &wait_for_go);
    let listed = format!("run (pid {}, GPUs 0-1)", long.id());
    let st = status_listing("lt-life", &listed);
    assert!(st.contains(&format!("  jobs      {listed}\n")), "{st}");
    let json = text(&closbox(&["status", "lt-life", "--json"])).0;
    let jobs = &serde_json::from_str::<serde_json::Value>(&json).unwrap()[0]["jobs"];
    assert_eq!(
        jobs,
        &serde_json::json!([{"kind": "run", "pid": long.id(), "gpus": "0-1"}]),
        "{json}"
    );
    // Each ends with a line naming the other.
    let ran_beside = |out: &std::process::Output, other: &str| {
        let (o, e) = text(out);
        assert!(out.status.success(), "{o}{e}");
        let line = format!("closbox: another job on fabric lt-life ran during this one: {other}: its traffic shared the fabric and the box's CPUs");
        assert!(e.contains(&line), "{e}");
    };
    let short = spawn("2,3", "true");
    let short_listed = format!("run (pid {}, GPUs 2-3)", short.id());
    ran_beside(&short.wait_with_output().unwrap(), &listed);
    std::fs::write(&go, "").unwrap();
    ran_beside(&long.wait_with_output().unwrap(), &short_listed);
    // A bench ended by Ctrl-C exits 130 and says it was interrupted, not that it failed.
    let bench = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args([
            "bench",
            "allreduce",
            "--fabric",
            "lt-life",
            "--sizes",
            "1M",
            "--iters",
            "100000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once its job is known to the fabric, and a moment for its agents to start.
    let listed = format!("bench (pid {}, GPUs all)", bench.id());
    status_listing("lt-life", &listed);
    std::thread::sleep(Duration::from_secs(1));
    let int = std::process::Command::new("kill")
        .args(["-INT", &bench.id().to_string()])
        .status()
        .unwrap();
    assert!(int.success());
    let ended = bench.wait_with_output().unwrap();
    let e = text(&ended).1;
    assert_eq!(ended.status.code(), Some(130), "{e}");
    assert!(
        e.contains("interrupted; the other ranks were stopped") && !e.contains("failed"),
        "{e}"
    );
    // Alone again: nothing listed, nothing said.
    assert!(!text(&closbox(&["status", "lt-life"])).0.contains("jobs"));
    let out = closbox(&["run", "--fabric", "lt-life", "--", "true"]);
    assert!(
        out.status.success() && !text(&out).1.contains("another job"),
        "{:?}",
        text(&out)
    );
    // A failing rank stops the others and names itself; a rank that ends within a moment
    // after it still says why (the first to fail is often not where a job broke).
    let started = Instant::now();
    let out = closbox(&[
        "run",
        "--fabric",
        "lt-life",
        "--",
        "sh",
        "-c",
        "[ $RANK = 2 ] && exit 3; [ $RANK = 1 ] && { sleep 0.3; echo why >&2; exit 4; }; sleep 30",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let e = text(&out).1;
    assert!(e.contains("rank 2 (gpu2) failed: exit status: 3; then rank 1 (gpu1): exit status: 4; the other ranks were stopped"), "{e}");
    assert!(e.contains("[1] why"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "others were not stopped"
    );
    let out = closbox(&[
        "run",
        "--fabric",
        "lt-life",
        "--gpus",
        "0,gpu3",
        "--timeout",
        "0.5",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(out.status.code(), Some(124));
    assert!(text(&out).1.contains("timed out"));
    let out = closbox(&["run", "--fabric", "lt-life", "--gpus", "0-7", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out)
            .1
            .contains("goes past the last GPU: fabric lt-life has ranks 0 to 3"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["run", "--fabric", "lt-life", "--gpus", "3-1", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).1.contains("goes downward"), "{:?}", text(&out));
    // Ranges of names too ("gpu1-gpu3" said there was no GPU of that name).
    let out = closbox_ok(&[
        "run",
        "-f",
        "lt-life",
        "--gpus",
        "gpu1-gpu3,gpu0",
        "--",
        "hostname",
    ]);
    let stdout = text(&out).0;
    let mut names: Vec<&str> = stdout.lines().collect();
    names.sort();
    // (Ranks in the selection's order.)
    assert_eq!(
        names,
        ["[0] gpu1", "[1] gpu2", "[2] gpu3", "[3] gpu0"],
        "{:?}",
        text(&out)
    );
    let out = closbox(&["run", "-f", "lt-life", "--gpus", "gpu3-gpu1", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out)
            .1
            .contains("\"gpu3-gpu1\" goes downward; write gpu1-gpu3"),
        "{:?}",
        text(&out)
    );
    // Ranks follow the selection's order, and so do node ranks.
    let out = closbox(&[
        "run",
        "--fabric",
        "lt-life",
        "--gpus",
        "3,1",
        "--",
        "sh",
        "-c",
        "echo $RANK $NODE_RANK $LOCAL_RANK $CLOSBOX_GPU",
    ]);
    let mut lines: Vec<String> = text(&out).0.lines().map(str::to_owned).collect();
    lines.sort();
    assert_eq!(
        lines,
        ["[0] 0 0 0 gpu3", "[1] 1 1 0 gpu1"],
        "{:?}",
        text(&out)
    );

    // A server a job left behind in a GPU (in a session of its own: not the job's process
    // group) outlives the job; `down` stops it and says so, daemon running or not.
    let out = closbox_ok(&[
        "run",
        "--fabric",
        "lt-life",
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!",
    ]);
    let server: i32 = text(&out)
        .0
        .trim()
        .trim_start_matches("[0] ")
        .parse()
        .unwrap();
    // Alive: a state other than zombie in /proc/PID/stat (gone: no file, or a zombie its
    // new parent, the box's init, has not reaped yet).
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| Some(s.rsplit_once(") ")?.1.starts_with(|c| c != 'Z')))
            .unwrap_or(false)
    };
    assert!(alive(server));
    // A job still running: `down` says it ends with the fabric (its rank is stopped too).
    let mut job = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(["run", "--fabric", "lt-life", "--gpus", "0", "--"])
        .args(["sh", "-c", "echo started; exec sleep 300"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut job), "[0] started\n");
    let listed = format!("run (pid {}, GPUs 0)", job.id());
    let out = closbox_ok(&["down", "lt-life"]);
    let said = text(&out).0;
    assert!(
        said.contains("daemon stopped")
            && said.contains("stopped 2 process(es) left in its GPUs: [")
            && said.contains(&server.to_string())
            && said.contains(&format!("; 1 job running on it lost its GPUs: {listed}")),
        "{said:?}"
    );
    assert!(!alive(server));
    let ended = job.wait_with_output().unwrap();
    assert!(!ended.status.success());
    f.down();
    // Idempotent.
    let out = closbox(&["down", "lt-life"]);
    assert!(out.status.success());
    assert!(text(&out).0.contains("not up"));
}

/// `up` in the foreground, ended by Ctrl-C (SIGINT): it takes the fabric down and names the
/// processes it stopped in the GPUs.
#[test]
fn a_foreground_up_ended_by_ctrl_c_says_what_it_stopped() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    use std::io::BufRead as _;
    let name = "lt-fg";
    assert!(leftovers(name).is_empty(), "{:?}", leftovers(name));
    let config = scratch_dir().join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[fabric]\nname = \"{name}\"\n{}",
            leaf_spine_4("1Gbit", "1us")
        ),
    )
    .unwrap();
    let mut up = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(["up", config.to_str().unwrap(), "--time-scale", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(up.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("fabric lt-fg up: 4 GPUs"), "{first:?}");
    let out = closbox(&[
        "exec",
        "-f",
        name,
        "gpu3",
        "--",
        "sh",
        "-c",
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!",
    ]);
    let server: i32 = text(&out).0.trim().parse().unwrap();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &up.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    assert!(up.wait().unwrap().success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert_eq!(
        rest,
        [format!(
            "fabric lt-fg is down; stopped 1 process(es) left in its GPUs: [{server}]"
        )]
    );
    assert!(leftovers(name).is_empty(), "{:?}", leftovers(name));
}

#[test]
fn down_cleans_up_after_sigkill_and_two_fabrics_coexist() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let a = TestFabric::up("lt-a", &leaf_spine_4("1Gbit", "1us"));
    let b = TestFabric::up("lt-b", &leaf_spine_4("1Gbit", "1us"));
    for f in [&a, &b] {
        let out = f.exec("gpu0", &["hostname"]);
        assert_eq!(text(&out).0.trim(), "gpu0");
    }
    // A process left running inside a GPU, then the daemon killed with SIGKILL.
    let mut sleeper = a.spawn("gpu1", &["sleep", "300"]);
    std::thread::sleep(Duration::from_millis(200));
    let pid = a.daemon_pid();
    assert!(std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(Duration::from_millis(200));
    let out = closbox(&["status", "lt-a"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out).0.contains("daemon not running"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["exec", "--fabric", "lt-a", "gpu0", "--", "true"]);
    assert!(text(&out).1.contains("not running"), "{:?}", text(&out));
    a.down();
    assert!(sleeper.wait().is_ok());
    // The other fabric is untouched.
    let out = b.exec("gpu3", &["hostname"]);
    assert_eq!(text(&out).0.trim(), "gpu3");
    b.down();
}

#[test]
fn broken_config_and_half_made_fabric_leak_nothing() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let dir = common::scratch_dir();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[fabric]\nname = \"lt-bad\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\n",
    )
    .unwrap();
    let out = closbox(&["up", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out)
            .1
            .contains("bad.toml:3:1: topology kind \"leaf-spine\" needs `spines`"),
        "{:?}",
        text(&out)
    );
    assert!(leftovers("lt-bad").is_empty());

    // A namespace name that already exists (someone else's): `up` refuses and touches
    // nothing, not even that namespace.
    std::fs::create_dir_all("/run/netns").unwrap();
    std::fs::write("/run/netns/cb-lt-half.gpu2", "").unwrap();
    let cfg = dir.join("half.toml");
    std::fs::write(
        &cfg,
        format!(
            "[fabric]\nname = \"lt-half\"\n{}",
            leaf_spine_4("1Gbit", "1us")
        ),
    )
    .unwrap();
    let out = closbox(&["up", cfg.to_str().unwrap(), "--detach"]);
    assert!(
        std::path::Path::new("/run/netns/cb-lt-half.gpu2").exists(),
        "someone else's file was removed"
    );
    std::fs::remove_file("/run/netns/cb-lt-half.gpu2").unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out)
            .1
            .contains("already exist: /run/netns/cb-lt-half.gpu2"),
        "{:?}",
        text(&out)
    );
    assert!(
        leftovers("lt-half").is_empty(),
        "{:?}",
        leftovers("lt-half")
    );

    // `up` SIGKILLed while it builds 256 GPUs (or just after): `down` removes everything.
    let su = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/superpod-su.toml"
    ))
    .unwrap()
    .replace("name = \"su\"", "name = \"lt-kill\"");
    let cfg = dir.join("kill.toml");
    std::fs::write(&cfg, su).unwrap();
    let mut up = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(["up", cfg.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::path::Path::new("/run/closbox/fabrics/lt-kill/state.json").exists()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(30));
    up.kill().unwrap();
    up.wait().unwrap();
    closbox_ok(&["down", "lt-kill"]);
    assert!(
        leftovers("lt-kill").is_empty(),
        "{:?}",
        leftovers("lt-kill")
    );
}

/// iperf3 from gpu0 to gpu3 (198.18.0.4) with `args`: its receiver's summary
/// (`end.sum_received`).
fn iperf_gpu0_to_gpu3(f: &TestFabric, args: &[&str]) -> serde_json::Value {
    iperf_between(f, "gpu0", "gpu3", "198.18.0.4", args)
}

/// iperf3 from GPU `from` to GPU `to` (serving at `addr`) with `args`: its receiver's
/// summary.
fn iperf_between(
    f: &TestFabric,
    from: &str,
    to: &str,
    addr: &str,
    args: &[&str],
) -> serde_json::Value {
    iperf_json(f, from, to, addr, args)["end"]["sum_received"].clone()
}

/// iperf3 from GPU `from` to GPU `to` (serving at `addr`) with `args`: the client's whole
/// JSON report.
fn iperf_json(
    f: &TestFabric,
    from: &str,
    to: &str,
    addr: &str,
    args: &[&str],
) -> serde_json::Value {
    let mut server = f.spawn(to, &["iperf3", "-s", "-1", "-B", addr]);
    wait_for_port(f, to, 5201);
    let cmd: Vec<&str> = ["iperf3", "-c", addr, "-J"]
        .iter()
        .chain(args)
        .copied()
        .collect();
    let out = f.exec(from, &cmd);
    let _ = server.wait();
    serde_json::from_slice(&out.stdout).expect("iperf3 JSON")
}

fn iperf_goodput(f: &TestFabric, seconds: u32) -> f64 {
    iperf_gpu0_to_gpu3(f, &["-t", &seconds.to_string()])["bits_per_second"]
        .as_f64()
        .expect("received rate")
}

/// TCP goodput across leaves is 93–100% of the configured link rate. With Ethernet
/// framing (38 B per 1500 B packet) the ceiling is 1448/1538 = 94.1%.
#[test]
fn tcp_goodput_matches_link_rate() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    // A run the fabric itself reports behind is repeated (`unless_behind`: a CI run read
    // p99 lateness 19.9 ms at real time and 92.1 % of 500 Mbit/s).
    for (rate, bps) in [("100Mbit", 100e6), ("500Mbit", 500e6)] {
        common::unless_behind(&format!("goodput at {rate} / the rate"), |_| {
            let f = TestFabric::up("lt-tcp", &leaf_spine_4(rate, "20us"));
            let got = iperf_goodput(&f, 5);
            let st = f.status();
            f.down();
            let ratio = got / bps;
            let behind = st["behind"] == true;
            eprintln!(
                "goodput at {rate}: {:.1} Mbit/s = {:.1}% (lateness p99 {} µs, behind {behind})",
                got / 1e6,
                ratio * 100.0,
                st["lateness"]["p99_us"]
            );
            common::Measured {
                value: ratio,
                met: (0.93..=1.0).contains(&ratio),
                behind,
            }
        });
    }
}

/// iperf3 UDP from gpu0 to gpu3 offered at `rate` in 8,000-byte datagrams (6 fragments
/// each at mtu 1500) for 2 s: bits a second received, and the share of datagrams lost.
fn iperf_udp(f: &TestFabric, rate: &str) -> (f64, f64) {
    iperf_udp_between(f, "gpu0", "gpu3", "198.18.0.4", rate)
}

/// UDP from `from` to `to` (at `addr`) offered at `rate`, 8,000-byte datagrams for 2 s:
/// (bits/s received, share of datagrams lost).
fn iperf_udp_between(f: &TestFabric, from: &str, to: &str, addr: &str, rate: &str) -> (f64, f64) {
    let r = iperf_between(
        f,
        from,
        to,
        addr,
        &["-u", "-b", rate, "-l", "8000", "-t", "2"],
    );
    (
        r["bits_per_second"].as_f64().expect("received rate"),
        r["lost_percent"].as_f64().expect("lost percent") / 100.0,
    )
}

/// A GPU that sends UDP above its link's rate is held to that rate, as a host's qdisc
/// holds the sending socket (the pacing qdisc on each GPU's TUN), and to the new rate
/// once the link is degraded: the datagrams arrive at the link's rate instead of being
/// lost in its NIC queue (without the qdisc: ~10 % of 1 Gbit/s received, 26 % of the
/// datagrams lost, the reassembly queue clogged with halves). With framing, 8,000 B of
/// payload take 8,356 B on the wire: the ceiling is 95.7 % of the link.
#[test]
fn udp_above_its_link_is_held_to_the_link_rate() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    common::unless_behind("UDP at 3 x the link", |_| {
        let f = TestFabric::up("lt-udp", &leaf_spine_4("100Mbit", "20us"));
        assert_eq!(f.status()["gpu_pacing"], true);
        let (full, lost_full) = iperf_udp(&f, "300M");
        closbox_ok(&[
            "link", "set", "gpu0", "leaf0", "--rate", "50Mbit", "-f", "lt-udp",
        ]);
        let (half, lost_half) = iperf_udp(&f, "300M");
        let nic = f.port("gpu0->leaf0");
        let st = f.status();
        f.down();
        let behind = st["behind"] == true;
        eprintln!(
            "UDP offered at 300 Mbit/s: {:.1} Mbit/s received on 100 Mbit/s ({:.2} % lost), {:.1} on 50 Mbit/s ({:.2} % lost); NIC queue drops {}, behind {behind}",
            full / 1e6,
            lost_full * 100.0,
            half / 1e6,
            lost_half * 100.0,
            nic["drops_buffer"]
        );
        common::Measured {
            value: (full, lost_full, half, lost_half),
            met: (0.88e8..=1e8).contains(&full)
                && (0.44e8..=0.5e8).contains(&half)
                && lost_full < 0.01
                && lost_half < 0.01
                && nic["drops_buffer"] == 0,
            behind,
        }
    });
}

/// A root qdisc a GPU's host put in place of closbox's (`tc qdisc replace dev cb0 root
/// tbf …`) is the host's: a change of the fabric that rewrites the pacing (here a rate
/// set on its link) leaves it, and `status` names it; a GPU that kept closbox's htb gets
/// the new rate, and one whose host deleted it (the kernel's default qdisc left) gets it
/// back (`tests/hardening.rs` too). (Before, the next `link set` replaced the host's tbf
/// with closbox's htb.) Both are known as the hosts make them, from the qdisc notices of
/// the GPUs' namespaces (before, only at the pacer's next change).
#[test]
fn a_qdisc_a_gpus_host_put_in_place_is_left_as_it_is() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-qdisc", &leaf_spine_4("100Mbit", "20us"));
    let tc = |gpu: &str, args: &[&str]| {
        let mut cmd = vec!["tc"];
        cmd.extend_from_slice(args);
        let out = f.exec(gpu, &cmd);
        assert!(out.status.success(), "{gpu}: {cmd:?}: {:?}", text(&out));
        text(&out).0
    };
    tc(
        "gpu0",
        &[
            "qdisc", "replace", "dev", "cb0", "root", "tbf", "rate", "10mbit", "burst", "32k",
            "latency", "10ms",
        ],
    );
    tc("gpu1", &["qdisc", "del", "dev", "cb0", "root"]);
    // Heard at once from the GPUs' namespaces (their qdisc notices), before any change of
    // the fabric: `status` names both, the events say what each host did.
    let heard = common::poll_until(
        || f.status()["gpu_qdiscs"].clone(),
        |h| h.as_array().is_some_and(|a| a.len() == 2),
    );
    assert_eq!(
        heard,
        serde_json::json!([["gpu0", "tbf"], ["gpu1", "none (deleted)"]]),
        "known only at the next change of the fabric before"
    );
    let events = text(&closbox(&["events", "lt-qdisc"])).0;
    assert!(
        events.contains("gpu0 root qdisc tbf, its host's in place of closbox's pacing")
            && events.contains("gpu1 root qdisc deleted by its host"),
        "{events}"
    );
    for (gpu, leaf) in [("gpu0", "leaf0"), ("gpu1", "leaf0"), ("gpu2", "leaf1")] {
        closbox_ok(&[
            "link", "set", gpu, leaf, "--rate", "50Mbit", "-f", "lt-qdisc",
        ]);
    }
    // The pacer works on its own thread: wait for gpu2's class to follow.
    let gpu2 = common::poll_until(
        || tc("gpu2", &["class", "show", "dev", "cb0"]),
        |c| c.contains("rate 50Mbit"),
    );
    assert!(
        gpu2.contains("rate 50Mbit"),
        "gpu2 kept closbox's qdisc: {gpu2}"
    );
    let gpu0 = tc("gpu0", &["qdisc", "show", "dev", "cb0"]);
    assert!(
        gpu0.starts_with("qdisc tbf ") && gpu0.contains("rate 10Mbit"),
        "{gpu0}"
    );
    let gpu1 = tc("gpu1", &["class", "show", "dev", "cb0"]);
    assert!(
        gpu1.contains("htb") && gpu1.contains("rate 50Mbit"),
        "{gpu1}"
    );
    // gpu1's laid anew: heard as closbox's again, and said.
    let events = common::poll_until(
        || text(&closbox(&["events", "lt-qdisc"])).0,
        |e| e.contains("gpu1 root qdisc closbox's pacing again"),
    );
    assert!(
        events.contains("gpu1 root qdisc closbox's pacing again"),
        "{events}"
    );
    let st = f.status();
    let own = st["gpu_qdiscs"].as_array().expect("gpu_qdiscs").clone();
    let words = closbox(&["status", "lt-qdisc"]);
    f.down();
    assert_eq!(own, [serde_json::json!(["gpu0", "tbf"])], "{own:?}");
    let line = text(&words).0;
    assert!(
        line.contains("their hosts' own, left as they are: gpu0 tbf ("),
        "{line}"
    );
}

/// GPUs with a NIC link to each of two switches, 100 Mbit/s links.
const DUAL_HOMED: &str = "[topology]\nkind = \"custom\"\n[links.nic]\nrate = \"100Mbit\"\ndelay = \"20us\"\n[[switch]]\nname = \"s0\"\ntier = \"leaf\"\n[[switch]]\nname = \"s1\"\ntier = \"leaf\"\n[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\n[[link]]\na = \"a\"\nb = \"s0\"\n[[link]]\na = \"a\"\nb = \"s1\"\n[[link]]\na = \"b\"\nb = \"s0\"\n[[link]]\na = \"b\"\nb = \"s1\"\n";

/// A GPU with two NIC links loses one: once routes have converged, its UDP is held to the
/// link it has left (the pacing qdisc follows the fabric's routes), not to the two links'
/// sum, of which that link would drop the excess in its NIC queue (before the qdisc
/// followed routes, 300 Mbit/s offered: 77.8 Mbit/s received, 6.8 % of the datagrams
/// lost, 5,468 frames dropped in that NIC's queue).
#[test]
fn udp_of_a_gpu_that_lost_a_nic_link_is_held_to_the_link_left() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    common::unless_behind("UDP at 3 x the NIC link left", |_| {
        let f = TestFabric::up("lt-dual", DUAL_HOMED);
        closbox_ok(&["link", "down", "a", "s1", "-f", "lt-dual"]);
        // Routes converge a few ms of fabric time later (real time here); the pacer then
        // lays a's classes anew.
        std::thread::sleep(Duration::from_millis(300));
        let (got, lost) = iperf_udp_between(&f, "a", "b", "198.18.0.2", "300M");
        let nic = f.port("a->s0");
        let st = f.status();
        f.down();
        let behind = st["behind"] == true;
        eprintln!(
            "UDP offered at 300 Mbit/s over the one NIC link left: {:.1} Mbit/s received ({:.2} % lost); NIC queue drops {}, behind {behind}",
            got / 1e6,
            lost * 100.0,
            nic["drops_buffer"]
        );
        common::Measured {
            value: (got, lost),
            met: (0.88e8..=1e8).contains(&got) && lost < 0.01 && nic["drops_buffer"] == 0,
            behind,
        }
    });
}

/// Median one-way latency (half of sockperf's ping-pong round trip), µs. The client polls
/// its socket (`--nonblocked`): a client that sleeps through a long round trip is woken
/// ~35 µs late by this VM (halt polling gives up after ~100 µs), which is the host's
/// latency, not the fabric's.
/// Three TCP streams at once: both ways between gpu0 and gpu3 (leaf0 to leaf1) and gpu1 to
/// gpu2, as (receiver, its address, sender, seed).
const THREE_STREAMS: [(&str, &str, &str, u32); 3] = [
    ("gpu3", "198.18.0.4", "gpu0", 1),
    ("gpu0", "198.18.0.1", "gpu3", 2),
    ("gpu2", "198.18.0.3", "gpu1", 3),
];

/// Sends `bytes` pseudo-random bytes along each of `streams` at once (port 7000,
/// `tests/scripts/stream_check.py`) and checks that each receiver got exactly them: what
/// the receivers said, a line each.
fn streams_arrive_intact(
    f: &TestFabric,
    streams: &[(&str, &str, &str, u32)],
    bytes: u64,
) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/stream_check.py");
    let n = bytes.to_string();
    let receivers: Vec<_> = streams
        .iter()
        .map(|&(to, _, _, seed)| {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"));
            c.args([
                "exec", "--fabric", &f.name, to, "--", "python3", script, "recv",
            ]);
            c.arg("7000");
            c.args([&seed.to_string(), &n]);
            c.stdout(std::process::Stdio::piped());
            let child = c.spawn().expect("closbox exec");
            wait_for_port(f, to, 7000);
            child
        })
        .collect();
    let senders: Vec<_> = streams
        .iter()
        .map(|&(_, addr, from, seed)| {
            let seed = seed.to_string();
            f.spawn(from, &["python3", script, "send", addr, "7000", &seed, &n])
        })
        .collect();
    for mut s in senders {
        assert!(s.wait().unwrap().success(), "a sender failed");
    }
    let mut said = Vec::new();
    for (r, (to, ..)) in receivers.into_iter().zip(streams) {
        let out = r.wait_with_output().unwrap();
        let line = format!("{to}: {}", String::from_utf8_lossy(&out.stdout).trim());
        assert!(out.status.success(), "{line}");
        said.push(line);
    }
    said.join("; ")
}

/// Frames lost on a link (2 % each way on gpu0's) and dropped at a full queue (a 20 KB
/// buffer toward gpu3) take frames out of the middle of super-packets: what is left of
/// each is written as the frames that survived (cut anew, headers rewritten), and TCP's
/// retransmissions fill the gaps. Every byte arrives intact (the receiving stack trusts
/// the partial checksums the fabric writes, so it is checked here byte for byte).
#[test]
fn streams_through_loss_and_full_queues_arrive_intact() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-intact", &leaf_spine_4("1Gbit", "20us"));
    for change in [
        ["gpu0", "leaf0", "--loss", "0.02"],
        ["leaf1", "gpu3", "--buffer", "20KB"],
    ] {
        let out = closbox(&[&["link", "set"][..], &change[..], &["-f", "lt-intact"]].concat());
        assert!(out.status.success(), "{:?}", text(&out));
    }
    let said = streams_arrive_intact(&f, &THREE_STREAMS, 20_000_000);
    let (lost, st) = f.drops("loss");
    let (full, _) = f.drops("buffer_full");
    f.down();
    eprintln!("{said}; fabric drops: loss {lost}, buffer_full {full}");
    assert!(lost > 100 && full > 0, "drops on the way: {st}");
}

/// Writer threads (`CLOSBOX_TUN_WRITERS`, the default on boxes of more than 2 cores, which
/// this 2-core CI would otherwise never run) carry every byte intact, with and without TUN
/// offload: three TCP streams at once, both ways between two GPUs and a third pair, each
/// checked byte for byte against the stream sent (the receiving stack trusts the partial
/// checksums the fabric writes: TCP's checksum would not catch a mangled payload), with
/// UDP at 300 Mbit/s alongside, which iperf3 counts out of order. Links of 10 Gbit/s,
/// beyond what this box carries on time, so that the data plane falls behind and hands
/// writes to its threads (it writes inline while on time): `status` counts them, and the
/// test fails if none were. Each port's order across writers is the unit test's
/// (`writer_threads_keep_each_ports_order_and_report_every_write`): here a race between
/// two writers is rare (a build alternating a port's writes between the writers kept
/// UDP in order on this box).
#[test]
fn writer_threads_keep_bytes_intact_and_flows_in_order() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    for offload in ["1", "0"] {
        let f = TestFabric::up_env(
            "lt-writers",
            &leaf_spine_4("10Gbit", "5us"),
            &[],
            &[("CLOSBOX_TUN_WRITERS", "2"), ("CLOSBOX_OFFLOAD", offload)],
        );
        let comms: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", f.daemon_pid()))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_owned())
            .filter(|c| c.starts_with("tun-writer"))
            .collect();
        assert_eq!(
            comms.len(),
            2,
            "offload {offload}: writer threads {comms:?}"
        );
        assert_eq!(f.status()["tun_writers"], 2);
        // UDP alongside, gpu1 to gpu2 as one of the streams, so that it too is written
        // while the data plane is behind (iperf3's own port, 5201).
        let mut udp_server = f.spawn("gpu2", &["iperf3", "-s", "-1", "-B", "198.18.0.3"]);
        wait_for_port(&f, "gpu2", 5201);
        let udp_client = {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"));
            c.args(["exec", "--fabric", &f.name, "gpu1", "--"]);
            c.args(["iperf3", "-c", "198.18.0.3", "-J"]);
            c.args(["-u", "-b", "300M", "-l", "1400", "-t", "3"]);
            c.stdout(std::process::Stdio::piped());
            c.spawn().expect("closbox exec")
        };
        let said = streams_arrive_intact(&f, &THREE_STREAMS, 40_000_000);
        eprintln!("offload {offload}: {said}");
        let out = udp_client.wait_with_output().unwrap();
        let _ = udp_server.wait();
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
        // The receiver's counts, as the client reports them at the end.
        let udp = report["end"]["streams"][0]["udp"].clone();
        let st = f.status();
        f.down();
        let handed = st["writes_handed_off"].as_u64().expect("a count");
        eprintln!(
            "offload {offload}: {handed} writes handed to the writer threads; UDP {} datagrams, {} lost, {} out of order; lateness p99 {} µs",
            udp["packets"], udp["lost_packets"], udp["out_of_order"], st["lateness"]["p99_us"]
        );
        assert!(
            handed > 0,
            "offload {offload}: no write went to a writer thread: {st}"
        );
        let packets = udp["packets"].as_u64().expect("packets");
        assert!(packets > 10_000, "offload {offload}: UDP {udp}");
        assert_eq!(udp["out_of_order"], 0, "offload {offload}: UDP {udp}");
    }
}

fn one_way_us(f: &TestFabric, seconds: u32) -> f64 {
    // The polling client and the sleeping server on CPUs of their own (the first and the
    // last): a server woken on the CPU its client spins on waits for the client's time
    // slice. On one 2-core VM, unpinned, a third of the runs measured a 1 ms path's median
    // ~370 µs long (the rest within 5 µs of each other); pinned apart, 8 of 8 within 13 µs.
    let last = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
    let server_cpu = last.to_string();
    let mut server = f.spawn(
        "gpu3",
        &[
            "taskset",
            "-c",
            &server_cpu,
            "sockperf",
            "sr",
            "-i",
            "198.18.0.4",
            "-p",
            "11111",
        ],
    );
    wait_for_port(f, "gpu3", 11111);
    let out = f.exec(
        "gpu0",
        &[
            "taskset",
            "-c",
            "0",
            "sockperf",
            "pp",
            "-i",
            "198.18.0.4",
            "-p",
            "11111",
            "--nonblocked",
            "-t",
            &seconds.to_string(),
        ],
    );
    let _ = server.kill();
    let _ = server.wait();
    let (o, e) = text(&out);
    let all = format!("{o}{e}");
    all.lines()
        .find(|l| l.contains("percentile 50.000"))
        .and_then(|l| l.rsplit('=').next()?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no median in sockperf output:\n{all}"))
}

/// One-way delay equals the configured path delay plus the emulator's floor (measured
/// with zero delay) within max(5%, 30 µs).
#[test]
fn one_way_delay_matches_configuration() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    // The floor and the paths measured under the same conditions, again if the host stole.
    common::unless_stolen("one-way delays", |_| {
        let f = TestFabric::up("lt-delay", &leaf_spine_4("1Gbit", "0ns"));
        let floor = one_way_us(&f, 2);
        f.down();
        eprintln!("floor (zero configured delay): {floor:.1} µs one way");
        let mut missed = Vec::new();
        // The path gpu0 → gpu3 crosses four links.
        for (per_link, path_us) in [("50us", 200.0), ("250us", 1000.0), ("2500us", 10_000.0)] {
            let f = TestFabric::up("lt-delay", &leaf_spine_4("1Gbit", per_link));
            let got = one_way_us(&f, 3);
            f.down();
            let want = path_us + floor;
            let tolerance = (0.05 * path_us).max(30.0);
            eprintln!(
                "path {path_us} µs: measured {got:.1} µs, expected {want:.1} ± {tolerance:.0}"
            );
            if (got - want).abs() > tolerance {
                missed.push(format!(
                    "path {path_us} µs: measured {got:.1}, expected {want:.1} ± {tolerance}"
                ));
            }
        }
        let met = missed.is_empty();
        (missed, met)
    });
}

/// The scheduling policy (`/proc/PID/task/TID/stat` field 41: 0 normal, 1 FIFO) of the
/// data-plane thread of the daemon serving `config`.
fn dataplane_policy(config: &str) -> u32 {
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(config) {
            continue;
        }
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.trim() != "dataplane" {
                continue;
            }
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap();
            // Fields after the command name in parentheses; policy is field 41.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            return rest.split(' ').nth(41 - 3).unwrap().parse().unwrap();
        }
    }
    panic!("no data-plane thread serving {config}");
}

/// `up --realtime`: the data plane runs in SCHED_FIFO and says so; delays stay those of
/// the configuration; a data plane busy for longer than the valve's 10 ms (a synthetic
/// load at the links' rate keeps it polling for departures 12 µs apart) leaves the FIFO
/// class for a while, and `status` counts it.
#[test]
fn realtime_data_plane_with_its_safety_valve() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up_with("lt-rt", &leaf_spine_4("1Gbit", "250us"), &["--realtime"]);
    assert_eq!(dataplane_policy("lt-rt.toml"), 1, "SCHED_FIFO");
    let st = f.status();
    let sched = st["scheduling"].as_str().unwrap().to_owned();
    assert!(sched.starts_with("real-time (SCHED_FIFO 10)"), "{sched}");
    assert!(sched.contains(": 0 time(s)"), "{sched}");
    // Four links of 250 µs, plus this box's floor and its timed wake-ups' lateness (the
    // data plane sleeps until each frame is due): 1038–1064 µs in 4 runs on the dev VM,
    // 1110 once in CI. The bound is for a path honoured, not collapsed or doubled.
    let got = common::unless_stolen("--realtime, path 1000 µs", |_| {
        let got = one_way_us(&f, 2);
        eprintln!("--realtime, path 1000 µs: {got:.1} µs one way");
        (got, (1000.0..1200.0).contains(&got))
    });
    assert!(got >= 1000.0, "{got} µs one way");
    let bps = iperf_goodput(&f, 2);
    assert!(bps > 0.5e9, "{bps} bit/s");
    // The valve, driven by a steady load rather than by iperf3: a TCP flow that does not
    // fill the link (its window short of the path, as in one CI run where the box was
    // slow: one way 1,105 µs) sends in bursts, the loop sleeps between them, and the
    // valve had nothing to do.
    closbox_ok(&[
        "load", "gpu0", "gpu1", "--rate", "1Gbit", "--for", "300ms", "--fabric", "lt-rt",
    ]);
    std::thread::sleep(Duration::from_millis(600));
    let st = f.status();
    // What the thread did over the last seconds (the flow's 2 s among them), read from the
    // kernel's schedstat: it ran, at most a CPU's worth (its busiest half second too).
    let cpu = &st["cpu_recent"];
    let (window, busy, peak) = (
        cpu["window_s"].as_f64().unwrap_or_else(|| panic!("{cpu}")),
        cpu["busy"].as_f64().unwrap(),
        cpu["peak_busy"].as_f64().unwrap(),
    );
    assert!((0.25..12.0).contains(&window), "{cpu}");
    assert!(busy > 0.01 && busy <= peak && peak <= 1.05, "{cpu}");
    assert!(cpu["waited_ms"].as_f64().unwrap() >= 0.0, "{cpu}");
    assert_eq!(st["realtime"], true);
    let sched = st["scheduling"].as_str().unwrap().to_owned();
    let fell: u64 = sched
        .rsplit(": ")
        .next()
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{sched}"));
    assert!(fell >= 1, "{sched}");
    f.down();
    // Without the flag: the normal class.
    let f = TestFabric::up("lt-rt", &leaf_spine_4("1Gbit", "0ns"));
    assert_eq!(dataplane_policy("lt-rt.toml"), 0, "SCHED_OTHER");
    let st = f.status();
    assert!(st["scheduling"]
        .as_str()
        .unwrap()
        .starts_with("normal class"));
    assert_eq!(st["realtime"], false);
    f.down();
}

/// `up --idle-poll`: the daemon asks the kernel for a CPU latency of 0 (idle CPUs poll)
/// for as long as it runs, says so in `status` (and whether this kernel honours it), and
/// the request goes with the daemon, whether taken down or killed.
#[test]
fn idle_poll_is_held_while_the_fabric_is_up_and_released_however_it_ends() {
    use closbox_switchd::sys::cpu_latency_target;
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let before = cpu_latency_target().expect("/dev/cpu_dma_latency");
    let body = leaf_spine_4("1Gbit", "0ns");
    let f = TestFabric::up_with("lt-idle", &body, &["--idle-poll"]);
    assert_eq!(cpu_latency_target().unwrap(), 0, "while up");
    let st = f.status();
    assert_eq!(st["idle_poll"], true);
    let sched = st["scheduling"].as_str().unwrap();
    // Only a kernel with a cpuidle driver honours the request; status says which.
    match closbox_switchd::sys::idle_poll_unavailable() {
        None => assert!(sched.contains("idle CPUs poll"), "{sched}"),
        Some(why) => assert!(
            sched.contains("without effect") && sched.contains(&why),
            "{sched}"
        ),
    }
    // The fabric works as ever.
    assert!(one_way_us(&f, 2) > 0.0);
    f.down();
    assert_eq!(cpu_latency_target().unwrap(), before, "after down");
    // A daemon killed outright: the kernel drops its request with its files.
    let f = TestFabric::up_with("lt-idle", &body, &["--idle-poll"]);
    assert_eq!(cpu_latency_target().unwrap(), 0);
    let daemon = f.daemon_pid();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &daemon.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{daemon}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        cpu_latency_target().unwrap(),
        before,
        "after the daemon was killed"
    );
    f.down();
    // Without the flag nothing is asked.
    let f = TestFabric::up("lt-idle", &body);
    assert_eq!(
        cpu_latency_target().unwrap(),
        before,
        "up without --idle-poll"
    );
    assert_eq!(f.status()["idle_poll"], false);
    f.down();
}

/// A TCP flow with IP options (a 60-byte IP header) beside a plain one to the same GPU:
/// every byte arrives and the daemon lives (coalescing read the plain flow's shorter
/// frames at the optioned flow's header offsets and panicked the data plane).
#[test]
fn tcp_with_ip_options_beside_another_flow_is_carried() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-ipopt", &leaf_spine_4("100Gbit", "0ns"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/ip_options.py");
    let counts = scratch_dir().join("ip_options.txt");
    let mut server = f.spawn(
        "gpu3",
        &[
            "/usr/bin/python3",
            script,
            "server",
            counts.to_str().unwrap(),
        ],
    );
    wait_for_port(&f, "gpu3", 7002);
    let sent = f.exec("gpu0", &["/usr/bin/python3", script, "client", "gpu3"]);
    assert!(server.wait().unwrap().success(), "the server");
    let (sent, got) = (text(&sent).0, std::fs::read_to_string(&counts).unwrap());
    assert_eq!(sent.trim(), got.trim(), "bytes sent and received per port");
    assert!(!sent.contains("=0"), "{sent}");
    let st = f.status();
    assert_eq!(st["io_errors"], 0);
    f.down();
}

/// Packets to a GPU whose interface its host set down: the fabric wrote them into the
/// downed TUN, and the GPU's kernel dropped them (`gpu_kernel`, counted since the
/// seventeenth landing). Its link is now down (the thirty-eighth): they are dropped in the
/// fabric, on the way (`link_down` at first, `no_route` once routes converged at the
/// other leaf and the spines), and nothing reaches its kernel. The counters the status
/// adds are still read (`gpu_rx_dropped`: 0, not missing).
#[test]
fn packets_to_a_gpu_whose_interface_is_down_are_dropped_in_the_fabric() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-gpudrop", &leaf_spine_4("1Gbit", "1us"));
    let ok = |o: &std::process::Output| assert!(o.status.success(), "{:?}", text(o));
    ok(&f.exec("gpu3", &["ip", "link", "set", "cb0", "down"]));
    let lost = f.exec(
        "gpu0",
        &["ping", "-c", "5", "-i", "0.05", "-W", "1", "-q", "gpu3"],
    );
    assert!(
        text(&lost).0.contains("5 packets transmitted, 0 received"),
        "{:?}",
        text(&lost)
    );
    let st = f.status();
    assert_eq!(st["gpu_rx_dropped"], 0, "{st}");
    assert_eq!(st["delivered"], 0, "{st}");
    let (link_down, _) = f.drops("link_down");
    let (no_route, v) = f.drops("no_route");
    assert_eq!(link_down + no_route, 5, "{v}");
    ok(&f.exec("gpu3", &["ip", "link", "set", "cb0", "up"]));
    // Its routes converge 10 ms after its link comes up (`route_convergence`).
    std::thread::sleep(Duration::from_millis(200));
    ok(&f.exec("gpu0", &["ping", "-c", "1", "-W", "5", "-q", "gpu3"]));
    let st = f.status();
    assert_eq!(st["delivered"], 2, "one there and back: {st}");
    let (o, _) = text(&closbox(&["status", "lt-gpudrop"]));
    assert!(o.contains("tun_kernel 0  gpu_kernel 0"), "{o}");
    f.down();
}

/// Datagrams the fabric delivered to a socket that never reads (a 2 KiB receive buffer):
/// the GPU's kernel drops them, and `status` says so (`gpu_socket`, and a `sockets` line)
/// rather than leaving an iperf3 user to blame the fabric for the loss it reports.
#[test]
fn udp_dropped_at_a_full_socket_buffer_is_counted_in_the_gpu() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-sockdrop", &leaf_spine_4("1Gbit", "1us"));
    let hold = "import socket, time\n\
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)\n\
                s.bind(('0.0.0.0', 9999))\n\
                time.sleep(300)";
    let mut holder = f.spawn("gpu3", &["/usr/bin/python3", "-c", hold]);
    wait_for_port(&f, "gpu3", 9999);
    let send = "import socket\n\
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                for _ in range(200): s.sendto(b'x' * 1000, ('gpu3', 9999))";
    let o = f.exec("gpu0", &["/usr/bin/python3", "-c", send]);
    assert!(o.status.success(), "{:?}", text(&o));
    // Delivered by the fabric (a 2 KiB buffer holds one or two of them), all of them.
    let deadline = Instant::now() + Duration::from_secs(5);
    let st = loop {
        let st = f.status();
        if st["delivered"] == 200 || Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(st["delivered"], 200, "{st}");
    let dropped = st["gpu_socket_dropped"].as_u64().expect("counted");
    assert!((190..=200).contains(&dropped), "{st}");
    let (o, _) = text(&closbox(&["status", "lt-sockdrop"]));
    assert!(o.contains(&format!("gpu_socket {dropped}")), "{o}");
    assert!(o.contains("UDP datagrams dropped inside the GPUs"), "{o}");
    let _ = holder.kill();
    let _ = holder.wait();
    f.down();
}

/// Unmodified torch.distributed (gloo) all-reduce across 8 GPUs through the fabric.
#[test]
fn torch_gloo_all_reduce_runs_unmodified() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up(
        "lt-torch",
        "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 4\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n",
    );
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/allreduce_gloo.py"
    );
    let out = closbox(&[
        "run",
        "--fabric",
        "lt-torch",
        "--timeout",
        "300",
        "--",
        "/usr/bin/python3",
        script,
    ]);
    let (o, e) = text(&out);
    let st = f.status();
    f.down();
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..8 {
        assert!(
            o.contains(&format!("[{r}] rank {r}/8 on gpu{r}: ok")),
            "rank {r} missing:\n{o}\n{e}"
        );
    }
    assert!(st["delivered"].as_u64().unwrap() > 1000, "{st}");
}

/// The agents through a live fabric: every collective correct, predictions alongside,
/// training steps in both modes. (Speeds are for the benchmarks and the note, not here.)
#[test]
fn bench_and_train_through_the_fabric() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let body = common::shipped_body("default.toml", "time_scale = 4000");
    let f = TestFabric::up("lt-bench", &body);
    let out = closbox(&[
        "bench",
        "allreduce",
        "broadcast,reduce",
        "allgather",
        "reducescatter",
        "alltoall",
        "sendrecv",
        "--fabric",
        "lt-bench",
        "--sizes",
        "4K,1M",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
    ]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&o).unwrap();
    assert_eq!(rows.len(), 7 * 2);
    for r in &rows {
        assert_eq!(r["wrong"], 0, "{r}");
        assert_eq!(r["ranks"], 8);
        assert!(r["predicted_us"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["time_us"].as_f64().unwrap() > 0.0, "{r}");
        // One timed iteration: its slowest rank's time is the slowest rank's mean.
        assert_eq!(r["iter_us"].as_array().map(Vec::len), Some(1), "{r}");
        assert_eq!(r["iter_us"][0], r["time_us"], "{r}");
        // Every agent reported its connections; the fabric hashes each onto one path.
        assert_eq!(r["predicted_on"], "run_paths", "{r}");
        assert!(r["box_behind"].is_boolean(), "{r}");
    }
    // What the fabric did during the run, counted from two status snapshots. The seven
    // 1 MiB operations send ~7 MiB per rank; at least 3 MiB per rank in 9000-byte frames.
    let footer = e
        .lines()
        .find(|l| l.starts_with("# fabric during the run: "))
        .unwrap_or_else(|| panic!("no footer in\n{e}"));
    let packets: u64 = footer["# fabric during the run: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    assert!(packets > 3 * 8 * (1 << 20) / 9000, "{footer}");
    // Sizes the agents cannot hold on this box are refused before any starts (each agent
    // aborted on its allocation of 1 TiB).
    for args in [
        &["bench", "--fabric", "lt-bench", "--sizes", "1T"][..],
        &[
            "train", "--fabric", "lt-bench", "--model", "1T", "--bucket", "1G",
        ],
    ] {
        let out = closbox(args);
        let (o, e) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {o}\n{e}");
        assert!(
            e.contains("more than the") && e.contains("available"),
            "{e}"
        );
        assert!(!e.contains("rank"), "an agent started: {e}");
    }
    for algo in ["tree", "rhd", "hier", "ring"] {
        let out = closbox(&[
            "bench", "--fabric", "lt-bench", "--gpus", "0-4", "--sizes", "100K", "--iters", "1",
            "--algo", algo, "--dtype", "bf16", "--redop", "max", "--csv",
        ]);
        let (o, e) = text(&out);
        assert!(out.status.success(), "{algo}: {o}\n{e}");
        let line = o.lines().nth(1).unwrap();
        assert!(line.starts_with(&format!("allreduce,{algo},5,")), "{line}");
        assert_eq!(line.split(',').nth(12), Some("0"), "{line}");
        // min_us and max_us last: one iteration, both its time.
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 17, "{line}");
        assert_eq!(f[15], f[16], "{line}");
        assert_eq!(
            f[15].parse::<f64>().ok(),
            f[9].parse::<f64>().ok(),
            "{line}"
        );
    }
    let out = closbox(&[
        "train",
        "--fabric",
        "lt-bench",
        "--model",
        "8M",
        "--bucket",
        "2M",
        "--compute-ms",
        "1",
        "--steps",
        "1",
        "--json",
    ]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    let reports: Vec<serde_json::Value> = serde_json::from_str(&o).unwrap();
    assert_eq!(reports.len(), 2);
    assert_eq!(
        (
            reports[0]["overlap"].as_bool(),
            reports[1]["overlap"].as_bool()
        ),
        (Some(false), Some(true))
    );
    for r in &reports {
        assert_eq!(r["buckets"], 4);
        assert!(
            r["step_ms"].as_f64().unwrap() >= r["compute_ms"].as_f64().unwrap() * 0.9,
            "{r}"
        );
        assert!(r["predicted_step_ms"].as_f64().unwrap() > 0.0);
    }
    let out = closbox(&["bench", "nosuchop", "--fabric", "lt-bench"]);
    assert!(
        text(&out)
            .1
            .contains("unknown operation \"nosuchop\"; one of: allreduce,"),
        "{:?}",
        text(&out)
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "bad usage, as clap's own errors"
    );
    // One GPU has nothing to exchange: no "0.0 % scaling efficiency" from it, nor an
    // AllReduce "of 1,188 GB/s" (`--gpus 3` is GPU 3, not three GPUs: said).
    let out = closbox(&["train", "--fabric", "lt-bench", "--gpus", "1"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("needs 2 GPUs or more"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["bench", "--fabric", "lt-bench", "--gpus", "3"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("--gpus 3 selects one GPU (gpu3)")
            && text(&out).1.contains("--gpus 0-2 for the first 3"),
        "{:?}",
        text(&out)
    );
    f.down();
}

/// Unmodified Open MPI + mpi4py through a hand-written mpirun line: mpirun inside GPU 0
/// starts its remote daemons through `closbox exec` (tests/scripts/closbox-rsh as
/// plm_rsh_agent), as a user without `closbox mpirun` would.
#[test]
fn mpi_all_reduce_runs_unmodified() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-mpi", &leaf_spine_4("1Gbit", "5us"));
    let path = common::path_with_closbox();
    let mut cmd = vec!["env".to_owned(), path];
    cmd.extend(common::mpirun_args("allreduce_mpi.py"));
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    let out = f.exec("gpu0", &cmd);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..4 {
        assert!(
            o.contains(&format!("rank {r}/4 on gpu{r}: ok")),
            "rank {r} missing:\n{o}\n{e}"
        );
    }

    // `closbox mpirun`: the same without a line or a script, and mpi4py's own bundled
    // programs (written by others), checked by what they print.
    let mpirun = |gpus: &str, prog: &[&str]| {
        let mut a = vec![
            "mpirun",
            "--fabric",
            "lt-mpi",
            "--gpus",
            gpus,
            "--timeout",
            "120",
            "--",
        ];
        a.extend_from_slice(prog);
        closbox(&a)
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/allreduce_mpi.py"
    );
    let out = mpirun("all", &["/usr/bin/python3", script]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..4 {
        assert!(o.contains(&format!("rank {r}/4 on gpu{r}: ok")), "{o}\n{e}");
    }
    let out = mpirun(
        "3,1",
        &["/usr/bin/python3", "-m", "mpi4py.bench", "helloworld"],
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    assert!(
        o.contains("Hello, World! I am process 0 of 2 on gpu3."),
        "{o}\n{e}"
    );
    assert!(
        o.contains("Hello, World! I am process 1 of 2 on gpu1."),
        "{o}\n{e}"
    );
    let out = mpirun(
        "all",
        &[
            "/usr/bin/python3",
            "-m",
            "mpi4py.bench",
            "ringtest",
            "-n",
            "1024",
            "-l",
            "20",
        ],
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    assert!(
        o.contains("time for 20 loops = ") && o.contains("(4 processes, 1024 bytes)"),
        "{o}\n{e}"
    );
    // A failing program: its exit status, the failing rank named.
    let out = mpirun(
        "all",
        &["/usr/bin/python3", "-c", "import sys; sys.exit(3)"],
    );
    assert!(!out.status.success(), "{:?}", text(&out));
    // A program that is not there, or not a program: said as `run` says it (Open MPI's
    // launcher printed a banner and exited 132, closbox blaming rank 0).
    let out = mpirun("all", &["/no/such/program"]);
    assert_eq!(out.status.code(), Some(127), "{:?}", text(&out));
    assert!(text(&out).1.contains("command not found: /no/such/program"));
    let out = mpirun("all", &["/tmp"]);
    assert_eq!(out.status.code(), Some(126), "{:?}", text(&out));
    let out = closbox(&["mpirun", "--fabric", "lt-mpi", "--dry-run", "--", "./a.out"]);
    let (o, _) = text(&out);
    assert!(
        o.contains("plm_rsh_agent") && o.contains("rsh --fabric lt-mpi"),
        "{o}"
    );
    assert!(o.contains("--host gpu0,gpu1,gpu2,gpu3 -np 4"), "{o}");
    f.down();
}

/// The most `status` says the hypervisor took of the CPUs ("N % of the CPUs stolen by the
/// hypervisor"), in %; 0 where it says nothing of it.
fn stolen_pct(status: &str) -> f64 {
    status
        .split(" % of the CPUs stolen by the hypervisor")
        .filter_map(|before| before.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max)
}

/// `up --time-scale auto` measures the box through the fabric's own data path and
/// chooses: links far faster than the box need dilation for throughput; short steps need
/// enough dilation that the box's own wall time per exchange stays under 5 % of it. The
/// choice and its reasons are in `status`. `--time-scale K` overrides the file.
#[test]
fn time_scale_auto_is_measured_at_up() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let (mut chosen, mut timing_needs) = (Vec::new(), Vec::new());
    for rate in ["100Gbit", "1Gbit"] {
        let mut attempt = 0;
        let (k, fabric_us, box_us) = loop {
            let f = TestFabric::up_with(
                "lt-auto",
                &common::leaf_spine_4(rate, "1us"),
                &["--time-scale", "auto"],
            );
            let k = f.status()["time_scale"].as_f64().unwrap();
            // The trials leave nothing behind in the GPUs or the fabric: no connection
            // (FIN-WAIT sockets retransmitted their FINs into the fabric, 32 packets in its
            // first 3 s), no cached TCP metrics (the user's first connections would start from
            // the trials' round trips), no packet counted.
            for gpu in ["gpu0", "gpu1", "gpu2", "gpu3"] {
                let (ss, _) = text(&f.exec(gpu, &["ss", "-tanH", "state", "all"]));
                let conns: Vec<&str> = ss.lines().filter(|l| !l.starts_with("LISTEN")).collect();
                assert!(conns.is_empty(), "{rate}: {gpu} after calibration: {ss}");
                let (m, _) = text(&f.exec(gpu, &["ip", "tcp_metrics", "show"]));
                assert!(m.trim().is_empty(), "{rate}: {gpu}'s TCP metrics: {m}");
            }
            std::thread::sleep(Duration::from_millis(1500));
            assert_eq!(
                f.status()["packets_in"],
                0,
                "{rate}: the fabric carried packets"
            );
            let out = closbox(&["status", "lt-auto"]);
            let (o, _) = text(&out);
            f.down();
            assert!(
                o.contains("time_scale chosen at up (auto): the box carried"),
                "{o}"
            );
            // The exchanges' fabric time, measured from two scales, is the model's: one
            // 1538-byte frame (1500 + Ethernet framing) each way over two links of 1 µs,
            // serialized at each (at 1 Gbit/s 12.3 µs a link: 26.6 µs; at 100 Gbit/s 2.2 µs),
            // plus an ACK's serialization where it goes first.
            // "... took F µs of fabric time plus B µs of wall time the box adds".
            let timing = |before: &str, after: &str| -> f64 {
                o.split(before)
                    .nth(1)
                    .and_then(|r| r.split(after).next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no exchange timing in status: {o}"))
            };
            let fabric_us = timing("took ", " µs of fabric time");
            // Up to 1.4 × the model: in a slow phase of the box (the hypervisor taking 7–8 %
            // of the CPUs) 1 Gbit/s exchanges read 34.6–35.7 µs in four runs of four (one in
            // CI), the box's part not being the same at both timing scales then; a wall-time
            // reading would be ~165 µs here, which is what this tells apart.
            let model = if rate == "1Gbit" { 26.6 } else { 2.25 };
            let within = fabric_us >= model * 0.95 && fabric_us <= model * 1.4;
            // The two-scale reading assumes the box's part is the same at both scales, which
            // a host taking many of the CPUs breaks (a CI run: 40.0 µs for 1 Gbit/s while the
            // calibration saw 33 % stolen): such a run is repeated, up to twice; a quiet box
            // must meet the bound.
            let steal = stolen_pct(&o);
            if !within && steal >= 10.0 && attempt < 2 {
                eprintln!("{rate}: exchanges read {fabric_us} µs with {steal:.0} % of the CPUs stolen: again");
                attempt += 1;
                continue;
            }
            assert!(
                within,
                "{rate}: exchanges took {fabric_us} µs of fabric time, the model {model}: {o}"
            );
            // The wall time the box adds to an exchange, which the scale must shrink under 5 %
            // of the exchange's fabric time.
            let box_us = timing(" µs of fabric time plus ", " µs of wall time the box adds");
            break (k, fabric_us, box_us);
        };
        eprintln!(
            "{rate} links: time_scale auto chose {k} (exchange {fabric_us} µs, the box adds {box_us} µs)"
        );
        chosen.push(k);
        // What the box's part needs, up to the next 1-2-5 step.
        timing_needs.push(2.5 * box_us / (0.05 * fabric_us));
    }
    // 4 GPUs × 100 Gbit/s is beyond this box at real time; at 1 Gbit/s only the box's
    // tens of µs per exchange need dilating (a few tens at most). Beyond that, only as
    // far as the box's measured part demands: one CI run on a slow phase of the host
    // chose 10,000 for 100 Gbit/s, the box adding over 0.5 ms to each exchange.
    assert!(
        chosen[0] >= 5.0 && chosen[0] <= timing_needs[0].max(5000.0),
        "{chosen:?}, the box's part needs up to {timing_needs:?}"
    );
    assert!(
        chosen[1] <= timing_needs[1].max(200.0),
        "{chosen:?}, the box's part needs up to {timing_needs:?}"
    );
    assert!(chosen[0] > chosen[1], "{chosen:?}");
    // 10 ms links: the throughput trials run without the delays (TCP ramping up over 40 ms
    // round trips carried 0 % at every scale, and `auto` ended at 20,000), and exchanges
    // that long are not timed.
    // (The time scale `auto` chose on 4 GPUs with these links, and `status`.)
    let auto_on = |rate: &str, delay: &str| {
        let f = TestFabric::up_with(
            "lt-auto",
            &common::leaf_spine_4(rate, delay),
            &["--time-scale", "auto"],
        );
        let k = f.status()["time_scale"].as_f64().unwrap();
        let (o, _) = text(&closbox(&["status", "lt-auto"]));
        f.down();
        (k, o)
    };
    let (k, o) = auto_on("100Gbit", "10ms");
    assert!(k <= 1000.0, "10 ms links: time_scale {k}: {o}");
    assert!(o.contains("too slow to time"), "{o}");
    // 1 kbit/s links: less than a frame a second, nothing a trial could measure (every
    // trial carried 0 % and `auto` chose 2000); real time is kept.
    let (k, o) = auto_on("1kbit", "1us");
    assert_eq!(k, 1.0, "1 kbit/s links: {o}");
    assert!(o.contains("too few for a trial to measure"), "{o}");
    let f = TestFabric::up_with(
        "lt-auto",
        &common::leaf_spine_4("1Gbit", "1us"),
        &["--time-scale", "250"],
    );
    assert_eq!(f.status()["time_scale"].as_f64(), Some(250.0));
    f.down();
    let bad = closbox(&["up", "configs/default.toml", "--time-scale", "fast"]);
    assert_eq!(bad.status.code(), Some(2), "{:?}", text(&bad));
}

/// A GPU's NIC with `[nic] scheduler = "fq"` sends a small message of another flow
/// ahead of its own bulk backlog (it waits for the TSO burst the NIC took, ~0.5 ms at
/// 1 Gbit/s); with one FIFO it waits behind everything the GPU's TCP has queued (ping
/// measured 26–30 ms here).
#[test]
fn a_small_message_goes_ahead_of_its_gpus_bulk_flow_with_an_fq_nic() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    // The ping's median beside the bulk flow (ms), gpu0's NIC queue peak, and whether the
    // fabric said it was behind.
    let measure = |scheduler: &str| {
        let body = format!(
            "{}[nic]\nscheduler = \"{scheduler}\"\n",
            leaf_spine_4("1Gbit", "5us")
        );
        let f = TestFabric::up("lt-nicfq", &body);
        let mut server = f.spawn("gpu2", &["iperf3", "-s", "-1", "-B", "198.18.0.3"]);
        wait_for_port(&f, "gpu2", 5201);
        let mut bulk = f.spawn("gpu0", &["iperf3", "-c", "198.18.0.3", "-t", "4"]);
        std::thread::sleep(Duration::from_millis(1500));
        let out = f.exec("gpu0", &["ping", "-c", "10", "-i", "0.1", "198.18.0.4"]);
        let nic = f.port("gpu0->leaf0");
        let behind = f.status()["behind"] == true;
        let _ = bulk.wait();
        let _ = server.wait();
        f.down();
        let (o, e) = text(&out);
        // "64 bytes from 198.18.0.4: icmp_seq=1 ttl=62 time=0.304 ms", one per reply. The
        // median: one reply held up by the box (the hypervisor taking the CPUs for 20 ms,
        // seen in CI) moved the mean of ten past the bound, not the scheduler.
        let mut rtts: Vec<f64> = o
            .lines()
            .filter_map(|l| l.split("time=").nth(1)?.split(' ').next()?.parse().ok())
            .collect();
        assert!(rtts.len() >= 5, "too few replies in ping's output:\n{o}{e}");
        rtts.sort_by(f64::total_cmp);
        let median_ms = rtts[rtts.len() / 2];
        let peak = nic["max_queue_bytes"].as_u64().unwrap();
        eprintln!(
            "scheduler {scheduler}: ping beside a bulk flow {median_ms:.2} ms (median; {rtts:?}); gpu0's NIC queue peaked at {peak} bytes (behind {behind})"
        );
        // The bulk flow queued megabytes in gpu0's NIC either way.
        assert!(peak > 1 << 20, "{scheduler}: NIC queue peak {peak}");
        (median_ms, behind)
    };
    // A 20 µs path; 64 KiB at 1 Gbit/s is 0.54 ms. A run the fabric reports behind is
    // repeated (`unless_behind`: two CI runs in a stealing hour read 5.4 and 7.4 ms).
    common::unless_behind("fq: ping beside a bulk flow (ms)", |_| {
        let (median_ms, behind) = measure("fq");
        common::Measured {
            value: median_ms,
            met: median_ms < 2.0,
            behind,
        }
    });
    measure("fifo");
}

/// Two TCP senders into one GPU for `secs` (gpu1 and gpu2 to gpu0, each its own iperf3
/// server): their goodput together, in bits a second of wall time.
fn two_into_one(f: &TestFabric, secs: u32) -> f64 {
    let servers: Vec<_> = ["5201", "5202"]
        .iter()
        .map(|p| f.spawn("gpu0", &["iperf3", "-s", "-1", "-B", "198.18.0.1", "-p", p]))
        .collect();
    wait_for_port(f, "gpu0", 5201);
    wait_for_port(f, "gpu0", 5202);
    let t = secs.to_string();
    let clients: Vec<_> = [("gpu1", "5201"), ("gpu2", "5202")]
        .iter()
        .map(|(g, p)| {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_closbox"));
            cmd.args(["exec", "--fabric", &f.name, g, "--"])
                .args(["iperf3", "-c", "198.18.0.1", "-p", p, "-J", "-t", &t])
                .stdout(std::process::Stdio::piped());
            cmd.spawn().expect("iperf3 client")
        })
        .collect();
    let mut total = 0.0;
    for c in clients {
        let out = c.wait_with_output().expect("iperf3 client");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
        total += v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .expect("received rate");
    }
    for mut s in servers {
        let _ = s.wait();
    }
    total
}

/// `tcp_congestion = "host"`: the GPUs keep the host's default congestion control, and
/// `status` names it (it said "the host's default" without saying which; `bench`'s ECN
/// footnote then said how "the host's default" answers marks, BBR's not at all); and
/// what a GPU's host changed its TCP to since `up` (it said what `up` had set).
#[test]
fn the_hosts_congestion_control_is_named_where_the_gpus_keep_it() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let host = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
    let host = host.trim();
    let f = TestFabric::up(
        "lt-hostcc",
        "[topology]\nkind = \"single-switch\"\ngpus = 2\n[nic]\ntcp_congestion = \"host\"\n",
    );
    let out = f.exec(
        "gpu0",
        &["cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
    );
    let said = text(&closbox(&["status", "lt-hostcc"])).0;
    // A GPU's host changes its own TCP (root in its namespace): `status` and `bench`'s
    // footer say what the GPUs' kernels run now, not what `up` set (they did before).
    let other = if host == "reno" { "bbr" } else { "reno" };
    let set = f.exec(
        "gpu1",
        &[
            "sysctl",
            "-qw",
            &format!("net.ipv4.tcp_congestion_control={other}"),
            "net.ipv4.tcp_ecn=0",
        ],
    );
    let now = f.status()["gpu_tcp"].clone();
    let changed = text(&closbox(&["status", "lt-hostcc"])).0;
    f.down();
    assert_eq!(text(&out).0.trim(), host);
    assert!(
        said.contains(&format!(
            "  gpu tcp   the host's default congestion control ({host}), ECN requested"
        )),
        "{said}"
    );
    assert!(set.status.success(), "{:?}", text(&set));
    assert_eq!(
        now,
        serde_json::json!([
            {"congestion": host, "ecn": 1, "gpus": ["gpu0"]},
            {"congestion": other, "ecn": 0, "gpus": ["gpu1"]},
        ])
    );
    assert!(
        changed.contains(&format!(
            "{other}, ECN off: gpu1 (not alike: changed in some GPUs since up"
        )),
        "{changed}"
    );
}

/// Whether the host's `net.ipv4.<key>` (a list of names) lists `name`.
fn ipv4_sysctl_lists(key: &str, name: &str) -> bool {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/{key}"))
        .unwrap()
        .split_whitespace()
        .any(|c| c == name)
}

/// Fabrics that share closbox's DCTCP: the first registers it, the second holds the same
/// registration, so the first going down leaves it registered for the second (and for a
/// third brought up meanwhile), until the last one using it goes down. Before, the first's
/// `down` unregistered it under the second (a second `up` in between failed).
#[test]
fn fabrics_share_closbox_dctcp_until_the_last_goes_down() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    if ipv4_sysctl_lists("tcp_allowed_congestion_control", "dctcp") {
        eprintln!("skipped: this kernel lets namespaces use its own dctcp");
        return;
    }
    let registered = || ipv4_sysctl_lists("tcp_available_congestion_control", "closbox_dctcp");
    assert!(!registered(), "closbox_dctcp registered before the test");
    let body =
        "[topology]\nkind = \"single-switch\"\ngpus = 2\n\n[nic]\ntcp_congestion = \"dctcp\"\n";
    let a = TestFabric::up("lt-dca", body);
    let b = TestFabric::up("lt-dcb", body);
    assert!(registered());
    a.down();
    assert!(
        registered(),
        "the first fabric's down unregistered closbox_dctcp under the second"
    );
    // A connection in the second fabric runs it.
    let server = b.spawn("gpu1", &["iperf3", "-s", "-1", "-4", "-p", "5201"]);
    common::wait_for_port(&b, "gpu1", 5201);
    let out = b.exec(
        "gpu0",
        &[
            "sh",
            "-c",
            "iperf3 -c gpu1 -p 5201 -t 1 --json >/dev/null & sleep 0.3; ss -tin dst gpu1; wait",
        ],
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    assert!(o.contains("closbox_dctcp"), "{o}\n{e}");
    let _ = server.wait_with_output();
    let c = TestFabric::up("lt-dcc", body);
    b.down();
    assert!(registered(), "held by the third fabric");
    c.down();
    assert!(!registered(), "closbox_dctcp outlived the fabrics");
}

/// `tcp_congestion = "dctcp"`: on this kernel (no tcp_dctcp) the daemon registers
/// closbox's BPF DCTCP for its life, the GPUs run it, and it does what DCTCP is for: two
/// senders into one GPU through a port that marks above 24 KiB, a third of the path's
/// bandwidth-delay product (10 Gbit/s, ~80 µs round trip: ~100 KB), keep it full (95 % of
/// the rate measured) where Reno, halving its window at each marked round trip, leaves it
/// idle a third of the time (63 %); no drops either way. Unregistered when the fabric goes
/// down.
#[test]
fn dctcp_keeps_a_shallow_marking_port_full() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let kernel_has_it = ipv4_sysctl_lists("tcp_allowed_congestion_control", "dctcp");
    let available =
        || std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control").unwrap();
    let body = "time_scale = 100\nmtu = 9000\n\n[topology]\nkind = \"single-switch\"\ngpus = 4\n\n[links.nic]\nrate = \"10Gbit\"\ndelay = \"25us\"\n\n[switches.leaf]\nlatency = \"1us\"\nbuffer = \"4MiB\"\necn = { k = \"24KiB\" }\n\n[nic]\ntcp_congestion = \"dctcp\"\n";
    // The link's rate in wall time (time_scale 100: at 40 the data plane was at ~80 % of
    // a CPU and its p99 lateness within 2.5 x of the bar in quiet phases too, the same
    // shares at both), and TCP's share of a 9000-byte frame.
    let line = 10e9 / 100.0 * 8948.0 / 9038.0;
    let (dctcp, reno) = common::unless_behind("DCTCP and Reno into a shallow marking port", |_| {
        let f = TestFabric::up("lt-dctcp", body);
        let want = if kernel_has_it {
            "dctcp"
        } else {
            "closbox_dctcp"
        };
        let out = f.exec(
            "gpu1",
            &["cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
        );
        assert_eq!(text(&out).0.trim(), want, "{:?}", text(&out));
        if !kernel_has_it {
            assert!(
                available().split_whitespace().any(|c| c == "closbox_dctcp"),
                "{}",
                available()
            );
        }
        let out = closbox(&["status", "lt-dctcp"]);
        assert!(
            text(&out).0.contains(&format!("  gpu tcp   {want}")),
            "{}",
            text(&out).0
        );
        let dctcp = two_into_one(&f, 4) / line;
        let port = f.port("sw0->gpu0");
        let marked = port["ecn_marked"].as_u64().unwrap();
        assert!(marked > 0, "no ECN marks: {port}");
        assert_eq!(port["drops_buffer"], 0, "{port}");
        // The same GPUs with Reno (new connections take the namespace's default).
        closbox_ok(&[
            "run",
            "--fabric",
            "lt-dctcp",
            "--",
            "sysctl",
            "-qw",
            "net.ipv4.tcp_congestion_control=reno",
        ]);
        let reno = two_into_one(&f, 4) / line;
        let behind = f.status()["behind"] == true;
        f.down();
        eprintln!("two senders into a port marking at 24 KiB: DCTCP {:.1} %, Reno {:.1} % of the link (ECN marks {marked}, behind {behind})", dctcp * 100.0, reno * 100.0);
        common::Measured {
            value: (dctcp, reno),
            met: dctcp >= 0.88 && reno < dctcp - 0.1,
            behind,
        }
    });
    assert!(dctcp <= 1.01, "more than the link: {dctcp}");
    let _ = reno;
    if !kernel_has_it {
        assert!(
            !available().split_whitespace().any(|c| c == "closbox_dctcp"),
            "closbox_dctcp outlived its fabric: {}",
            available()
        );
    }
}
