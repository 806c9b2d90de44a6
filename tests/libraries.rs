//! Real collective libraries and third-party programs through live fabrics, as root: the
//! crate's fixture (`closbox::Fabric`), Open MPI and MPICH through `closbox mpirun`
//! (NetPIPE, ucx_perftest), every torch gloo collective in a 16-rank job, torchrun's
//! rendezvous across GPUs, fabric-time clocks for unmodified programs, and the pytest
//! plugin's sample suite. Each checks results (data,
//! or measured figures against the configured fabric), not only exit codes.

mod common;

use std::time::{Duration, Instant};

use common::{closbox, root_or_skip, serial, shipped_body, text, wait_for_port, TestFabric};

/// leaf-spine-16 as shipped: 1 Gbit/s everywhere; gpu0 -> gpu15 crosses leaf0, a spine and
/// leaf3: 2 + 5 + 5 + 2 µs of links and 3 × 1 µs of switches.
const LS16_PATH_US: f64 = 17.0;

/// The fields of a NetPIPE result line: "  0: 4194304 bytes  4 times --> 891.60 Mbps in
/// 35890.49 usec" -> (bytes, Mbit/s, µs).
fn netpipe_lines(out: &str) -> Vec<(u64, f64, f64)> {
    out.lines()
        .filter(|l| l.contains("times -->") && l.contains("Mbps"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let bytes = w[1].parse().expect("bytes");
            let i = w.iter().position(|x| *x == "Mbps").expect("Mbps");
            (bytes, w[i - 1].parse().unwrap(), w[i + 2].parse().unwrap())
        })
        .collect()
}

/// The crate's fixture itself: up from a TOML text, exec, typed status, a link change the
/// fabric then reports, and down on drop with nothing left.
#[test]
fn fixture_brings_up_runs_reports_and_cleans_up() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_closbox");
    // As root, with closbox built beside the tests: nothing stands in the way.
    assert_eq!(closbox::Fabric::unavailable(), None);
    // A bad topology fails before anything is created, naming the line.
    let err = closbox::Fabric::options()
        .binary(bin)
        .from_toml("[fabric]\nname = \"lfix\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 0\n")
        .unwrap_err();
    assert!(format!("{err:#}").contains(":5"), "{err:#}");
    assert!(common::leftovers("lfix").is_empty());

    let f = closbox::Fabric::options()
        .binary(bin)
        .from_toml(&format!(
            "[fabric]\nname = \"lfix\"\n{}",
            common::leaf_spine_4("1Gbit", "1us")
        ))
        .unwrap();
    assert_eq!(f.name(), "lfix");
    let out = f
        .exec(
            "gpu0",
            &[
                "/usr/bin/python3",
                "-c",
                "import socket; print(socket.gethostname())",
            ],
        )
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "gpu0");
    // A command that overstays its `--timeout` is stopped with what it started (124).
    let out = f
        .exec_with(
            &["--timeout", "0.3"],
            "gpu1",
            &["sh", "-c", "sleep 3613 & sleep 3614; wait"],
        )
        .unwrap();
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    let left = f.exec("gpu1", &["pgrep", "-f", "sleep 361[34]"]).unwrap();
    assert_eq!(left.status.code(), Some(1), "{left:?}");
    // A TCP exchange across the spine, counted by the daemon.
    let mut server = f
        .spawn("gpu3", &["/usr/bin/python3", "-c", "import socket\ns=socket.create_server(('', 7000))\nc,_=s.accept()\nc.sendall(c.recv(100))"])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let echoed = loop {
        let out = f
            .exec("gpu0", &["/usr/bin/python3", "-c", "import socket\nc=socket.create_connection(('gpu3', 7000))\nc.sendall(b'over the fabric')\nprint(c.recv(100).decode())"])
            .unwrap();
        if out.status.success() || Instant::now() > deadline {
            break String::from_utf8_lossy(&out.stdout).trim().to_owned();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = server.wait();
    assert_eq!(echoed, "over the fabric");
    let st = f.status().unwrap();
    assert_eq!(st.fabric, "lfix");
    assert_eq!(st.gpus, 4);
    assert!(st.delivered >= 6, "{} delivered", st.delivered);
    assert!(st
        .ports
        .iter()
        .any(|p| p.port == "gpu0->leaf0" && p.rx_packets > 0));
    f.link_down("leaf0", "spine0").unwrap();
    let st = f.status().unwrap();
    assert_eq!(st.changed_links.len(), 1, "{:?}", st.changed_links);
    // The daemon's refusal, as an error naming the fabric and what it refused.
    let err = format!("{:#}", f.link_down("leaf0", "nowhere").unwrap_err());
    assert!(
        err.starts_with("fabric lfix: ") && err.contains("nowhere"),
        "{err}"
    );
    let events = f.events().unwrap();
    let what: Vec<&str> = events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(what, ["link leaf0-spine0 #0 down"], "{events:?}");
    assert_eq!(events[0].seq, 1);
    // A scenario run to its end: its own events; the link taken down by hand stays down.
    let dir = common::test_dir("lfix");
    let scenario = dir.join("flap.toml");
    std::fs::write(
        &scenario,
        common::down_then_up("leaf0", "spine0", "0ms", "5ms"),
    )
    .unwrap();
    let run = f.chaos(&scenario).unwrap();
    let what: Vec<&str> = run.events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        what,
        [
            "link leaf0-spine0 #0 down (already so)",
            "link leaf0-spine0 #0 up (held down by hand)"
        ],
        "{run:?}"
    );
    assert!(run.events.iter().all(|e| e.timeline == Some(run.timeline)));
    assert_eq!(run.end, closbox::ChaosEnd::Followed);
    assert_eq!(run.meanwhile.map(|m| m.changed_links), Some(1));
    std::fs::write(&scenario, "[[event]]\nat = \"0ms\"\ndo = \"link-dow\"\n").unwrap();
    let err = f.chaos(&scenario).unwrap_err();
    assert!(format!("{err:#}").contains("flap.toml:3:"), "{err:#}");
    drop(f);
    assert!(
        common::leftovers("lfix").is_empty(),
        "{:?}",
        common::leftovers("lfix")
    );

    // One file up twice at once, each under a name of its own (`closbox up --name`), as
    // tests that run at once would: each its own GPUs, daemon and counters.
    let file = dir.join("twice.toml");
    std::fs::write(
        &file,
        format!(
            "[fabric]\nname = \"lfix\"\n{}",
            common::leaf_spine_4("1Gbit", "1us")
        ),
    )
    .unwrap();
    let up = |name: &str| closbox::Fabric::options().binary(bin).name(name).up(&file);
    let a = up("lfix-a").unwrap();
    // A name among `up`'s arguments is the fabric's name, as `Options::name` gives it.
    let b = closbox::Fabric::options()
        .binary(bin)
        .args(["--name", "lfix-b", "--detach"])
        .up(&file)
        .unwrap();
    assert_eq!((a.name(), b.name()), ("lfix-a", "lfix-b"));
    for f in [&a, &b] {
        let out = f
            .exec("gpu0", &["ping", "-c", "1", "-W", "5", "gpu3"])
            .unwrap();
        assert!(out.status.success(), "{}: {out:?}", f.name());
        let st = f.status().unwrap();
        assert_eq!(st.fabric, f.name());
        assert!(
            st.delivered >= 2,
            "{}: {} delivered",
            f.name(),
            st.delivered
        );
    }
    // Without a name, the file's is taken by none of them: two tests bringing it up at
    // once (threads, as cargo runs them) get it and the next free one, `lfix-2`; its
    // second `up` by hand exits 4, the status of a name already up.
    let (c, d) = std::thread::scope(|s| {
        let one = || closbox::Fabric::options().binary(bin).up(&file);
        let c = s.spawn(one);
        let d = s.spawn(one);
        (c.join().unwrap().unwrap(), d.join().unwrap().unwrap())
    });
    let mut names = [c.name(), d.name()];
    names.sort();
    assert_eq!(names, ["lfix", "lfix-2"]);
    for f in [&c, &d] {
        let out = f
            .exec("gpu0", &["ping", "-c", "1", "-W", "5", "gpu3"])
            .unwrap();
        assert!(out.status.success(), "{}: {out:?}", f.name());
        assert_eq!(f.status().unwrap().fabric, f.name());
    }
    // Both bound to this process (`up --owner`): a test killed mid-way leaves none.
    let said = text(&closbox(&["status", c.name()])).0;
    let owned = format!("goes down when pid {} ends", std::process::id());
    assert!(said.contains(&owned), "{said}");
    let out = closbox(&["up", file.to_str().unwrap(), "--detach"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    assert!(text(&out).1.contains("lfix is already up"), "{out:?}");
    drop(c);
    drop(d);
    // `down FILE` means the file's own name: nothing to do, saying where its fabric is up.
    let out = closbox(&["down", file.to_str().unwrap()]);
    let said = text(&out).0;
    assert!(
        out.status.success() && said.contains("is up as lfix-a, lfix-b"),
        "{said}"
    );
    // A name already up is refused, and the fabric under it left alone; a bad one named.
    let err = up("lfix-a").unwrap_err();
    assert!(format!("{err:#}").contains("already up"), "{err:#}");
    assert!(a.status().is_ok());
    let err = up("Lfix").unwrap_err();
    assert!(format!("{err:#}").contains("fabric name"), "{err:#}");
    // Both down in one command (their guards then find nothing to do).
    let out = closbox(&["down", "lfix-a", "lfix-b"]);
    let said = text(&out).0;
    assert!(
        out.status.success()
            && said.contains("fabric lfix-a is down")
            && said.contains("fabric lfix-b is down"),
        "{said}"
    );
    drop(a);
    drop(b);
    for name in ["lfix", "lfix-2", "lfix-a", "lfix-b"] {
        assert!(
            common::leftovers(name).is_empty(),
            "{:?}",
            common::leftovers(name)
        );
    }
}

/// NetPIPE (Debian netpipe-openmpi and netpipe-mpich2, unmodified) between gpu0 and gpu15
/// across the spine, through `closbox mpirun` with Open MPI and with MPICH: its integrity
/// check passes, its small-message latency is at least the configured path's, its
/// bandwidth at 4 MiB near (and not above) the 1 Gbit/s links.
#[test]
fn netpipe_through_open_mpi_and_mpich() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lnp", &shipped_body("leaf-spine-16.toml", ""));
    // `args`: closbox mpirun's own options, "--", then the program.
    let mpirun = |imp: &str, args: &[&str]| {
        let mut a = vec![
            "mpirun",
            "--fabric",
            "lnp",
            "--impl",
            imp,
            "--gpus",
            "0,15",
            "--timeout",
            "120",
        ];
        if !args.contains(&"--") {
            a.push("--");
        }
        a.extend_from_slice(args);
        let out = closbox(&a);
        let (o, e) = text(&out);
        // Debian's MPICH (4.0, ch4:ofi) sometimes never leaves MPI_Finalize after the
        // program is done: caught here (1 run in 17 of the 4 MiB one), rank 1 blocked in
        // its PMI barrier with 25 bytes from rank 0 unread in its socket, rank 0 spinning;
        // every byte delivered and acknowledged by the fabric (`ss`); in CI also after an
        // integrity run had passed every size. Accepted only when NetPIPE printed the
        // result of its last size (`-u`); what it printed is still checked below; any
        // other failure fails here.
        let last = args
            .iter()
            .position(|&x| x == "-u")
            .map(|i| format!(" {} bytes", args[i + 1]));
        let all = format!("{o}{e}");
        let printed_last = last.is_some_and(|last| {
            all.lines().any(|l| {
                l.contains(&last) && (l.contains("Mbps") || l.contains("Integrity check passed"))
            })
        });
        let finalize_hang = imp == "mpich"
            && !out.status.success()
            && e.contains("timed out after 120 s")
            && printed_last;
        if finalize_hang {
            eprintln!(
                "{imp} {args:?}: MPICH did not leave MPI_Finalize (known race), results kept"
            );
        } else {
            assert!(out.status.success(), "{imp} {args:?}:\n{o}\n{e}");
        }
        // NetPIPE reports on stderr.
        o + &e
    };
    // mpirun's standard input goes to rank 0 (Open MPI forwards it), as `closbox mpirun`'s
    // does (before: /dev/null).
    let out = common::closbox_with_input(
        &[
            "mpirun",
            "--fabric",
            "lnp",
            "--impl",
            "openmpi",
            "--gpus",
            "0,15",
            "--timeout",
            "60",
            "--",
            "cat",
        ],
        b"to rank 0\n",
    );
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    assert_eq!(o.matches("to rank 0").count(), 1, "{o}{e}");
    // A user's setting replaces closbox's own for the same key (Open MPI refuses a key
    // given twice, hydra would take the last).
    for (imp, flag, kv, key) in [
        (
            "openmpi",
            "--mca",
            ["mpi_yield_when_idle", "0"],
            "mpi_yield_when_idle",
        ),
        (
            "mpich",
            "-x",
            ["MPIR_CVAR_POLLS_BEFORE_YIELD=0", ""],
            "MPIR_CVAR_POLLS_BEFORE_YIELD",
        ),
    ] {
        let mut a = vec![
            "mpirun",
            "--fabric",
            "lnp",
            "--impl",
            imp,
            "--dry-run",
            flag,
            kv[0],
        ];
        if !kv[1].is_empty() {
            a.push(kv[1]);
        }
        a.extend(["--", "true"]);
        let out = closbox(&a);
        let (o, e) = text(&out);
        assert!(out.status.success(), "{o}{e}");
        assert_eq!(o.matches(key).count(), 1, "{o}");
        if imp == "openmpi" {
            assert!(o.contains("--mca mpi_event_tick_rate 1 "), "{o}");
        }
        // Both settings make the ranks busy-poll: pinned round robin over the CPUs (the dry run
        // places all 16 GPUs).
        assert!(
            o.starts_with("taskset -c ") && o.contains("--cpu-map gpu0=0,gpu1=1,gpu2=0,"),
            "{o}"
        );
    }
    for (imp, prog) in [("openmpi", "NPopenmpi"), ("mpich", "NPmpich2")] {
        let integrity = mpirun(
            imp,
            &[prog, "-i", "-l", "1", "-u", "1048576", "-o", "/dev/null"],
        );
        // NetPIPE's own verdict ("Integrity check failed: Expecting …"); not any "failed"
        // (hydra's cleanup after MPICH's known MPI_Finalize hang prints "assert (!closed)
        // failed" once the results are in).
        let passed = integrity.matches("Integrity check passed").count();
        assert!(
            passed >= 30 && !integrity.contains("Integrity check failed"),
            "{imp}: {passed} sizes checked\n{integrity}"
        );
        // One message size, `reps` round trips, no perturbation: NetPIPE's arguments.
        let one_size = |size: &'static str, reps: &'static str| {
            [
                prog,
                "-l",
                size,
                "-u",
                size,
                "-p",
                "0",
                "-n",
                reps,
                "-o",
                "/dev/null",
            ]
        };
        let lat = netpipe_lines(&mpirun(imp, &one_size("8", "300")));
        let bw = netpipe_lines(&mpirun(imp, &one_size("4194304", "4")));
        let (lat_us, mbps) = (lat[0].2, bw[0].1);
        if imp == "openmpi" {
            // Ranks that busy-poll (no yielding) run, pinned to CPUs of their own (the dry
            // run above checks the pinning). Their latency is printed, not asserted: 32–44
            // µs; 5.0 ms a message in 2 runs (CI, and once here after tests/chaos.rs)
            // before closbox set Open MPI's event tick rate (README).
            let mut busy = vec!["--mca", "mpi_yield_when_idle", "0", "--"];
            busy.extend(one_size("8", "300"));
            let spin = netpipe_lines(&mpirun(imp, &busy));
            eprintln!(
                "openmpi, busy-polling ranks: 8 B one way {:.1} µs",
                spin[0].2
            );
            assert!(spin[0].2 >= LS16_PATH_US, "{} µs", spin[0].2);
        }
        eprintln!(
            "{imp}: 8 B one way {lat_us:.1} µs (path {LS16_PATH_US} µs), 4 MiB {mbps:.0} Mbit/s"
        );
        assert!(
            lat_us >= LS16_PATH_US,
            "{imp}: {lat_us} µs is faster than the path"
        );
        assert!(lat_us < LS16_PATH_US + 500.0, "{imp}: {lat_us} µs");
        assert!(
            mbps <= 1000.0,
            "{imp}: {mbps} Mbit/s beyond the 1 Gbit/s links"
        );
        let floor = if imp == "openmpi" { 700.0 } else { 300.0 };
        assert!(mbps >= floor, "{imp}: {mbps} Mbit/s");
    }
    let st = f.status();
    f.down();
    assert!(st["delivered"].as_u64().unwrap() > 10_000, "{st}");
}

/// ucx_perftest (Debian ucx-utils, UCX's TCP transport on cb0) between gpu0 and gpu15:
/// tag-matching bandwidth at 1 MiB near the links' rate, latency above the path's.
#[test]
fn ucx_perftest_over_tcp_between_two_gpus() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lucx", &shipped_body("leaf-spine-16.toml", ""));
    let ucx = |test: &str, size: &str, iters: &str| {
        let env = ["env", "UCX_TLS=tcp", "UCX_NET_DEVICES=cb0", "ucx_perftest"];
        let mut server_cmd = env.to_vec();
        server_cmd.extend(["-p", "13337"]);
        let mut server = f.spawn("gpu15", &server_cmd);
        wait_for_port(&f, "gpu15", 13337);
        let mut client = env.to_vec();
        client.extend(["gpu15", "-p", "13337", "-t", test, "-s", size, "-n", iters]);
        let out = f.exec("gpu0", &client);
        let _ = server.wait();
        let (o, e) = text(&out);
        assert!(out.status.success(), "{test}:\n{o}\n{e}");
        // "Final:  200  8036.377  14035.823  9206.691  71.25  108.62  71  109":
        // iterations, overhead p50/avg/overall (µs), bandwidth avg/overall (MB/s), rates.
        let w: Vec<f64> = o
            .lines()
            .find(|l| l.starts_with("Final:"))
            .unwrap_or_else(|| panic!("no Final line:\n{o}"))
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        w
    };
    let lat = ucx("tag_lat", "8", "2000");
    let bw = ucx("tag_bw", "1048576", "200");
    f.down();
    let (lat_us, mib_s) = (lat[1], bw[5]);
    let gbit = mib_s * 1048576.0 * 8.0 / 1e9;
    eprintln!("ucx_perftest: 8 B latency {lat_us:.1} µs, 1 MiB tag_bw {gbit:.3} Gbit/s");
    assert!(
        (LS16_PATH_US..LS16_PATH_US + 500.0).contains(&lat_us),
        "{lat_us} µs"
    );
    assert!(
        (0.6..=1.0).contains(&gbit),
        "{gbit} Gbit/s over 1 Gbit/s links"
    );
}

/// torch.distributed's gloo backend, unmodified, 16 ranks on leaf-spine-16: all_reduce
/// (sum, max), broadcast, all_gather, gather, scatter, all_to_all_single and barrier, each
/// rank checking every result.
#[test]
fn torch_gloo_every_collective_in_16_ranks() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lgl16", &shipped_body("leaf-spine-16.toml", ""));
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/collectives_gloo.py"
    );
    let out = f
        .fabric()
        .run_with(&["--timeout", "300"], &["/usr/bin/python3", script])
        .unwrap();
    let (o, e) = text(&out);
    f.down();
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..16 {
        assert!(
            o.contains(&format!("[{r}] rank {r}/16 on gpu{r}: ok")),
            "rank {r}:\n{o}\n{e}"
        );
    }
}

/// torch's own launcher, `torchrun` (`python3 -m torch.distributed.run`), started on every
/// GPU by `closbox run`: 4 nodes of 2 workers each, meeting through the c10d rendezvous on
/// gpu0, every worker checking its all_reduce. Debian's torch 1.13 under Python 3.11 needs
/// `-r 9:1 -t 9:1` (its default `0` parses to no value there and torchrun fails at start,
/// outside closbox too): it names a local rank that does not exist, so none is redirected.
#[test]
fn torchrun_workers_meet_through_c10d_rendezvous() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("ltrun", &shipped_body("leaf-spine-16.toml", ""));
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/allreduce_gloo.py"
    );
    #[rustfmt::skip]
    let torchrun = [
        "/usr/bin/python3", "-m", "torch.distributed.run",
        "--nnodes", "4", "--nproc_per_node", "2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "gpu0:29400", "--rdzv_id", "closbox",
        "-r", "9:1", "-t", "9:1",
        script,
    ];
    let out = f
        .fabric()
        .run_with(&["--gpus", "0-3", "--timeout", "240"], &torchrun)
        .unwrap();
    let (o, e) = text(&out);
    f.down();
    assert!(out.status.success(), "{o}\n{e}");
    // The rendezvous numbers the workers; each GPU (node) runs two of them.
    let mut ranks = Vec::new();
    for line in o.lines().filter(|l| l.ends_with(": ok")) {
        // "[2] rank 5/8 on gpu2: ok"
        let w: Vec<&str> = line.split_whitespace().collect();
        let (rank, world) = w[2].split_once('/').unwrap();
        assert_eq!(world, "8", "{line}");
        ranks.push((
            rank.parse::<u32>().unwrap(),
            w[4].trim_end_matches(':').to_owned(),
        ));
    }
    ranks.sort();
    assert_eq!(
        ranks.iter().map(|r| r.0).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>(),
        "{o}\n{e}"
    );
    for g in 0..4 {
        let on = ranks.iter().filter(|r| r.1 == format!("gpu{g}")).count();
        assert_eq!(on, 2, "two workers on gpu{g}: {ranks:?}");
    }
}

/// `--fabric-clock` on default.toml (time_scale 4000): an unmodified torch script timing
/// its own 16 MiB all_reduce reads about what `closbox bench` reports for that size; a
/// deadline wait lasts its length in fabric time; a sleep stays in wall time.
#[test]
fn fabric_clock_gives_unmodified_programs_fabric_time() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lclk", &shipped_body("default.toml", "time_scale = 4000"));
    let out = closbox(&[
        "bench",
        "allreduce",
        "--fabric",
        "lclk",
        "--gpus",
        "0-3",
        "--sizes",
        "16M",
        "--iters",
        "3",
        "--json",
    ]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    let v: serde_json::Value = serde_json::from_str(&o).expect("bench JSON");
    let bench_us = v[0]["time_us"]
        .as_f64()
        .unwrap_or_else(|| panic!("no time_us in {v}"));

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/fabric_clock.py");
    let out = closbox(&[
        "run",
        "--fabric",
        "lclk",
        "--gpus",
        "0-3",
        "--fabric-clock",
        "--timeout",
        "300",
        "--",
        "/usr/bin/python3",
        script,
    ]);
    let (o, e) = text(&out);
    f.down();
    assert!(out.status.success(), "{o}\n{e}");
    let field = |key: &str| -> Vec<f64> {
        o.lines()
            .filter_map(|l| l.split_once(&format!("{key}=")))
            .map(|(_, v)| v.split_whitespace().next().unwrap().parse().unwrap())
            .collect()
    };
    let torch_us = field("allreduce_us");
    assert_eq!(torch_us.len(), 4, "{o}\n{e}");
    for t in &torch_us {
        let ratio = t / bench_us;
        eprintln!("torch's own timing {t:.1} µs, closbox bench {bench_us:.1} µs: {ratio:.2}");
        assert!(
            (0.85..=1.15).contains(&ratio),
            "torch {t} µs vs bench {bench_us} µs"
        );
    }
    // A 0.5 ms fabric-time wait is 2 s of wall time at 4000; a 0.2 s sleep stays 0.2 s.
    for w in field("wait_wall_s") {
        assert!((1.8..6.0).contains(&w), "wait took {w} s wall");
    }
    for s in field("sleep_wall_s") {
        assert!((0.15..1.0).contains(&s), "sleep took {s} s wall");
    }
}

/// The pytest plugin (python/pytest-closbox): pip-installed from its path (into a scratch
/// directory, offline), found by pytest through its entry point, and its sample suite
/// (gloo all-reduce, a failed uplink, MPI hello, a bad topology) passing with Debian's
/// pytest against the closbox under test.
#[test]
fn pytest_plugin_sample_suite_passes() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let scratch = common::scratch_dir().join("pytest");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/python/pytest-closbox");
    // A copy: pip builds in the source tree, which must stay clean.
    let run = |cmd: &mut std::process::Command| {
        let out = cmd.current_dir(&scratch).output().expect("run");
        let (o, e) = text(&out);
        assert!(out.status.success(), "{cmd:?}:\n{o}\n{e}");
        o
    };
    run(std::process::Command::new("cp").args(["-r", src, "pkg"]));
    run(std::process::Command::new("/usr/bin/python3").args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "--target",
        "site",
        "./pkg",
    ]));
    let out = run(std::process::Command::new("/usr/bin/python3")
        .args(["-m", "pytest", "pkg/tests", "-q", "-p", "no:cacheprovider"])
        .env("CLOSBOX_BIN", env!("CARGO_BIN_EXE_closbox"))
        .env("PYTHONPATH", scratch.join("site")));
    assert!(
        out.contains("14 passed") && !out.contains("failed"),
        "{out}"
    );
    // Under pytest-xdist (Debian's python3-pytest-xdist): two workers bring the suite's
    // files up at once, each under names with its id.
    let out = run(std::process::Command::new("/usr/bin/python3")
        .args([
            "-m",
            "pytest",
            "pkg/tests",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
        ])
        .env("CLOSBOX_BIN", env!("CARGO_BIN_EXE_closbox"))
        .env("PYTHONPATH", scratch.join("site")));
    assert!(
        out.contains("14 passed") && !out.contains("failed"),
        "{out}"
    );
    for name in [
        "pyt",
        "pyt-a",
        "pyt-b",
        "pyt-gw0",
        "pyt-gw1",
        "pyt-gw7",
        "pyt-sixteen-gw12",
    ] {
        assert!(
            common::leftovers(name).is_empty(),
            "{:?}",
            common::leftovers(name)
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

/// docs/ci.md as written: its files (`<!-- ci: PATH -->` before a fenced block) written to
/// a scratch checkout and its test step run there, with the closbox under test on PATH and
/// the pytest plugin importable (what the workflow's install step provides).
#[test]
fn ci_doc_commands_run_as_written() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ci.md"))
        .expect("docs/ci.md");
    let repo = common::scratch_dir().join("ci-doc");
    let _ = std::fs::remove_dir_all(&repo);
    let mut files = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        let Some(path) = l
            .strip_prefix("<!-- ci: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().expect("a fenced block after the marker");
        assert!(fence.starts_with("```"), "{path}: {fence}");
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        let file = repo.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, body.join("\n") + "\n").unwrap();
        files.push(path.to_owned());
    }
    assert_eq!(
        files,
        [
            "ci/fabric.toml",
            "ci/fabric-tests.sh",
            "tests/allreduce_test.py",
            "tests/test_on_fabric.py"
        ]
    );
    // The plugin, as `pip install` would make it importable (entry point included).
    let site = repo.join("site");
    let pkg = repo.join("pkg");
    let cp = std::process::Command::new("cp")
        .args([
            "-r",
            concat!(env!("CARGO_MANIFEST_DIR"), "/python/pytest-closbox"),
        ])
        .arg(&pkg)
        .status()
        .unwrap();
    assert!(cp.success());
    let pip = std::process::Command::new("/usr/bin/python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
        ])
        .args(["--no-index", "--target"])
        .args([&site, &pkg])
        .output()
        .unwrap();
    assert!(pip.status.success(), "{:?}", text(&pip));
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_closbox"))
        .parent()
        .unwrap();
    let out = std::process::Command::new("sh")
        .arg("ci/fabric-tests.sh")
        .current_dir(&repo)
        .env(
            "PATH",
            format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap()),
        )
        .env("PYTHONPATH", &site)
        .output()
        .unwrap();
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..8 {
        assert!(
            o.contains(&format!("[{r}] rank {r}/8: all_reduce ok")),
            "{o}\n{e}"
        );
    }
    assert!(o.contains("1 passed"), "{o}\n{e}");
    assert!(o.contains("fabric ci (8 GPUs"), "{o}\n{e}");
    assert!(
        common::leftovers("ci").is_empty(),
        "{:?}",
        common::leftovers("ci")
    );
    let _ = std::fs::remove_dir_all(&repo);
}
