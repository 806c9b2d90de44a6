use super::*;

fn shortest(body: &str) -> u64 {
    let t = closbox_fabric::parse(&format!("[fabric]\nname = \"t\"\n{body}"), "t.toml").unwrap();
    shortest_gpu_path(&t, &Routes::new(&t))
}

/// Ports in memory on a virtual clock: packets are queued to arrive at given times;
/// a wait jumps the clock to the next arrival or the timeout (at least 1 µs, as the
/// real loop's polling would take), never sleeping.
struct MemPorts {
    start: StdInstant,
    elapsed: StdDuration,
    inbox: Vec<std::collections::VecDeque<(StdDuration, Vec<u8>)>>,
    sent: Vec<(usize, StdDuration, Frame)>,
    done: Vec<(u64, bool)>,
    /// Interface MTUs the GPUs' hosts set, handed over at the next wait.
    links: Vec<(usize, HostLink)>,
    /// The carriers the fabric set (`Ports::set_carrier`), in order.
    carriers: Vec<(usize, bool)>,
    /// Called as each wait begins, with the clock then.
    on_wait: Option<Box<dyn FnMut(StdDuration) + Send>>,
}

impl MemPorts {
    fn new(n: usize) -> MemPorts {
        MemPorts {
            start: StdInstant::now(),
            elapsed: StdDuration::ZERO,
            inbox: vec![Default::default(); n],
            sent: Vec::new(),
            done: Vec::new(),
            links: Vec::new(),
            carriers: Vec::new(),
            on_wait: None,
        }
    }
}

impl Ports for MemPorts {
    fn count(&self) -> usize {
        self.inbox.len()
    }

    fn now(&self) -> StdInstant {
        self.start + self.elapsed
    }

    fn wait(&mut self, timeout: StdDuration, ready: &mut Vec<usize>) -> io::Result<()> {
        if let Some(f) = &mut self.on_wait {
            f(self.elapsed);
        }
        let until = self.elapsed + timeout.max(StdDuration::from_micros(1));
        let next = self
            .inbox
            .iter()
            .filter_map(|q| q.front().map(|p| p.0))
            .min();
        match next {
            Some(t) if t <= until => self.elapsed = self.elapsed.max(t),
            _ => self.elapsed = until,
        }
        for (i, q) in self.inbox.iter().enumerate() {
            if q.front().is_some_and(|p| p.0 <= self.elapsed) {
                ready.push(i);
            }
        }
        Ok(())
    }

    fn recv(&mut self, port: usize) -> io::Result<Option<(Frame, StdInstant)>> {
        let q = &mut self.inbox[port];
        if q.front().is_none_or(|p| p.0 > self.elapsed) {
            return Ok(None);
        }
        Ok(q.pop_front()
            .map(|(_, p)| (p.into(), self.start + self.elapsed)))
    }

    fn send(&mut self, out: &mut Vec<Outgoing>) {
        for o in out.drain(..) {
            let late = self.now().saturating_duration_since(o.due).as_nanos() as u64;
            self.done.push((late, false));
            self.sent.push((o.port, self.elapsed, o.data));
        }
    }

    fn finished(&mut self, done: &mut Vec<(u64, bool)>) {
        done.append(&mut self.done);
    }

    fn link_changes(&mut self, out: &mut Vec<(usize, HostLink)>) {
        out.append(&mut self.links);
    }

    fn set_carrier(&mut self, port: usize, on: bool) {
        self.carriers.push((port, on));
    }
}

fn plane(body: &str) -> (DataPlane<MemPorts>, Topology) {
    let t = closbox_fabric::parse(&format!("[fabric]\nname = \"t\"\n{body}"), "t.toml").unwrap();
    let (_tx, rx) = std::sync::mpsc::channel();
    (DataPlane::new(&t, MemPorts::new(t.hosts.len()), rx), t)
}

/// Steps the data plane until its virtual clock reaches `until`.
fn step_to(dp: &mut DataPlane<MemPorts>, until: StdDuration) {
    while dp.ports.elapsed < until {
        dp.step();
    }
}

/// Whether an event starts with `start` and ends with `end`.
fn said(dp: &DataPlane<MemPorts>, start: &str, end: &str) -> bool {
    dp.events
        .iter()
        .any(|e| e.what.starts_with(start) && e.what.ends_with(end))
}

fn udp(t: &Topology, from: usize, to: usize, len: usize) -> Vec<u8> {
    closbox_fabric::packet::build_udp(t.hosts[from].addr, t.hosts[to].addr, 1, 2, 0, len)
}

const TWO: &str = "[topology]\nkind = \"single-switch\"\ngpus = 2\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[switches.leaf]\nlatency = \"500ns\"\n";

#[test]
fn a_turn_reads_a_port_up_to_a_byte_budget_or_a_frame_count() {
    // Jumbo frames: about two super-packets' worth (128 KiB) from a port, then the other
    // ports, then what fell due meanwhile is written (reading 64 jumbo frames a turn held
    // those writes back: write lateness p99 342-371 us for one flow against 157-182 us);
    // small frames: at most 64 a turn (their reads are cheap, and fewer turns carry more).
    for (len, per_turn) in [(9000, 15), (1000, 64)] {
        let (mut dp, t) = plane(&format!("mtu = 9000\n{TWO}"));
        for _ in 0..100 {
            dp.ports.inbox[0].push_back((StdDuration::ZERO, udp(&t, 0, 1, len)));
        }
        dp.ports.inbox[1].push_back((StdDuration::ZERO, udp(&t, 1, 0, 100)));
        dp.step();
        assert_eq!(100 - dp.ports.inbox[0].len(), per_turn, "{len} B frames");
        assert!(dp.ports.inbox[1].is_empty(), "{len} B frames");
    }
}

#[test]
fn a_packet_leaves_at_its_fabric_time_scaled_to_the_wall_clock() {
    for k in [1u64, 1000] {
        let (mut dp, t) = plane(&format!("time_scale = {k}\n{TWO}"));
        // 1000 B + 38 B of framing = 8304 ns a hop at 1 Gbit/s, twice; 1 µs a link,
        // twice; 500 ns in the switch.
        let fabric_ns = 2 * 8304 + 2 * 1000 + 500;
        let sent_at = StdDuration::from_micros(3);
        dp.ports.inbox[0].push_back((sent_at, udp(&t, 0, 1, 1000)));
        for _ in 0..10_000 {
            dp.step();
            if !dp.ports.sent.is_empty() {
                break;
            }
        }
        let (port, at, data) = dp.ports.sent[0].clone();
        assert_eq!(port, 1);
        assert_eq!(data.len(), 1000);
        let want = sent_at + StdDuration::from_nanos(fabric_ns * k);
        // The loop polls in 1 µs steps once it is within SPIN of the departure.
        assert!(
            at >= want && at <= want + StdDuration::from_micros(1),
            "k {k}: {at:?} vs {want:?}"
        );
        let st = dp.status();
        assert_eq!((st.packets_in, st.delivered), (1, 1));
        assert_eq!(st.lateness.samples, 1);
        assert!(st.lateness.max_us <= 1.0, "{:?}", st.lateness);
    }
}

#[test]
fn the_wake_margin_follows_late_wake_ups_and_decays() {
    let mut m = WakeMargin::default();
    assert_eq!(m.get(), SPIN);
    m.observe(StdDuration::from_micros(200));
    assert_eq!(m.get(), StdDuration::from_micros(210));
    // On time for a while: back down to SPIN.
    for _ in 0..400 {
        m.observe(StdDuration::ZERO);
    }
    assert_eq!(m.get(), SPIN);
    m.observe(StdDuration::from_secs(1));
    assert_eq!(m.get(), MAX_SPIN);
}

#[test]
fn the_loop_counts_drops_and_stops_on_request() {
    let (mut dp, t) = plane(TWO);
    // Not IPv4, a packet to nowhere, TTL 1 (expires in the switch): all dropped.
    let mut ttl1 = udp(&t, 0, 1, 100);
    closbox_fabric::packet::set_ttl(&mut ttl1, 1);
    for p in [vec![0x60; 40], udp(&t, 0, 0, 100), ttl1] {
        dp.ports.inbox[0].push_back((StdDuration::ZERO, p));
    }
    for _ in 0..100 {
        dp.step();
    }
    let st = dp.status();
    let drops: std::collections::BTreeMap<String, u64> = st.drops.into_iter().collect();
    assert_eq!(drops["unsupported"], 1);
    assert_eq!(drops["no_route"], 1);
    assert_eq!(drops["ttl_expired"], 1);
    // Nothing reached gpu1; gpu0 got the switch's ICMP time exceeded.
    assert_eq!(dp.ports.sent.len(), 1, "{:?}", dp.ports.sent);
    let (port, _, icmp) = &dp.ports.sent[0];
    let icmp = icmp.to_vec();
    assert_eq!((*port, icmp[9], icmp[20]), (0, 1, 11));
    // A stop request ends the loop.
    let (tx, rx) = std::sync::mpsc::channel();
    dp.ctl = rx;
    tx.send(Ctl::Stop).unwrap();
    assert!(!dp.step());
}

#[test]
fn a_flap_is_applied_on_schedule_in_fabric_time() {
    let (mut dp, _t) = plane(&format!("time_scale = 10\n{TWO}"));
    let now = dp.applied_now();
    let applied = dp
        .change(&ChangeRequest::LinkFlap {
            a: "gpu0".into(),
            b: "sw0".into(),
            index: None,
            down_ns: 10_000,
            up_ns: 5_000,
            count: 2,
        })
        .unwrap();
    assert_eq!(applied.len(), 1, "the first down is now");
    for _ in 0..100_000 {
        dp.step();
        if dp.events.len() == 4 {
            break;
        }
    }
    let got: Vec<(u64, &str)> = dp
        .events
        .iter()
        .map(|e| (e.fabric_ns - now, e.what.as_str()))
        .collect();
    let whats: Vec<&str> = got.iter().map(|g| g.1).collect();
    assert_eq!(
        whats,
        [
            "link gpu0-sw0 #0 down (flap 1 of 2); gpu0 lost its carrier (NO-CARRIER: none of its links is up)",
            "link gpu0-sw0 #0 up (flap 1 of 2); gpu0 got its carrier back",
            "link gpu0-sw0 #0 down (flap 2 of 2); gpu0 lost its carrier (NO-CARRIER: none of its links is up)",
            "link gpu0-sw0 #0 up (flap 2 of 2); gpu0 got its carrier back"
        ]
    );
    // On time to within the loop's 1 µs polling (0.1 µs of fabric time at k = 10).
    for ((at, _), want) in got.iter().zip([0u64, 10_000, 15_000, 25_000]) {
        assert!(*at >= want && *at <= want + 200, "{at} vs {want}");
    }
    let e = dp
        .change(&ChangeRequest::LinkFlap {
            a: "gpu0".into(),
            b: "sw0".into(),
            index: None,
            down_ns: 0,
            up_ns: 5_000,
            count: 2,
        })
        .unwrap_err();
    assert!(e.contains("above 0"), "{e}");
}

/// A leaf-spine of 4 GPUs under 2 spines, 1 Gbit/s, detection 20 µs, convergence
/// 100 µs.
const LS: &str = "failure_detection = \"20us\"\nroute_convergence = \"100us\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n";

/// Event log (fabric ns since start, what), drops by reason, the load's drops.
type Replay = (Vec<(u64, String)>, Vec<(String, u64)>, u64);

/// Runs a seeded random-flap scenario with a load and GPU traffic across the spines:
/// the event log (fabric times relative to the start) and the drop counts.
fn flap_run(seed: u64) -> Replay {
    let (mut dp, t) = plane(LS);
    let scenario = crate::scenario::parse(
        &format!(
            "seed = {seed}\n[[event]]\nat = \"0ns\"\ndo = \"load\"\nfrom = \"gpu2\"\nto = \"leaf0\"\nrate = \"300Mbit\"\nfor = \"5ms\"\n[[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"1ms\"\nmttr = \"200us\"\nuntil = \"5ms\"\n"
        ),
        "s.toml",
        &t,
    )
    .unwrap();
    // gpu0 → gpu2 and gpu3 → gpu1: a 1000-byte packet every 20 µs each, 250 of them,
    // several flows so that ECMP uses both spines.
    for i in 0..250u64 {
        let at = StdDuration::from_micros(20 * i + 3);
        let flow = |from: usize, to: usize| {
            let (a, b) = (t.hosts[from].addr, t.hosts[to].addr);
            closbox_fabric::packet::build_udp(a, b, 1 + (i % 7) as u16, 2, 0, 1000)
        };
        dp.ports.inbox[0].push_back((at, flow(0, 2)));
        dp.ports.inbox[3].push_back((at, flow(3, 1)));
    }
    let start = dp.applied_now();
    let (_, applied) = dp.schedule(&scenario.items).unwrap();
    assert_eq!(applied.len(), 1, "the load starts at once");
    step_to(&mut dp, StdDuration::from_millis(8));
    let st = dp.status();
    assert_eq!(st.pending_changes, 0);
    assert!(st.delivered > 250, "most get through: {}", st.delivered);
    let load_drops: u64 = st
        .loads
        .iter()
        .flat_map(|l| l.drops.iter())
        .map(|d| d.1)
        .sum();
    let log = dp
        .events
        .iter()
        .map(|e| (e.fabric_ns - start, e.what.clone()))
        .collect();
    (log, st.drops, load_drops)
}

#[test]
fn a_seeded_flap_scenario_replays_exactly() {
    let (log, drops, load_drops) = flap_run(11);
    assert_eq!(flap_run(11), (log.clone(), drops.clone(), load_drops));
    let downs = log.iter().filter(|e| e.1.ends_with(" down")).count();
    assert!(downs >= 5, "{log:?}");
    let lost = |r: &str| drops.iter().find(|d| d.0 == r).unwrap().1;
    assert!(lost("link_down") + lost("no_route") > 0, "{drops:?}");
    assert!(load_drops > 0);
    let (other, _, _) = flap_run(12);
    assert_ne!(other, log, "another seed, other faults");
}

/// Random changes by hand and by scenarios (downs, ups, sets, resets, flaps, switch
/// failures, partitions, cancels) on a small fabric, time passing between them: after
/// each, a link is down exactly while someone holds it down, and every link is at its
/// own values under the degrades in place; a reset leaves nothing held.
#[test]
fn holds_follow_the_fabric_under_random_changes() {
    use closbox_fabric::routing::PortId;
    const LINKS: [(&str, &str); 5] = [
        ("leaf0", "spine0"),
        ("leaf0", "spine1"),
        ("leaf1", "spine0"),
        ("leaf1", "spine1"),
        ("gpu0", "leaf0"),
    ];
    let mut checked = 0;
    for seed in 0..12 {
        let (mut dp, t) = plane(LS);
        let mut rng = closbox_fabric::rng::Rng::new(seed, 7);
        let ms = |rng: &mut closbox_fabric::rng::Rng| (1 + rng.below(3) as u64) * 1_000_000;
        let random = |rng: &mut closbox_fabric::rng::Rng| {
            let (a, b) = LINKS[rng.below(LINKS.len() as u32) as usize];
            let from = (a == "leaf0" && rng.below(3) == 0).then(|| "leaf0".to_owned());
            let (a, b) = (a.to_owned(), b.to_owned());
            let spine = format!("spine{}", rng.below(2));
            match rng.below(11) {
                0 => ChangeRequest::LinkDown { a, b, index: None },
                1 => ChangeRequest::LinkUp { a, b, index: None },
                2 => ChangeRequest::LinkSet {
                    a,
                    b,
                    index: None,
                    rate_bps: (rng.below(2) == 0).then(|| 1_000_000 * (1 + rng.below(900) as u64)),
                    delay_ns: (rng.below(2) == 0).then(|| 1_000 * rng.below(50) as u64),
                    loss: Some(rng.below(10) as f64 / 100.0),
                    loss_burst: None,
                    buffer_bytes: None,
                    from,
                },
                3 => ChangeRequest::LinkReset { a, b, index: None },
                4 => ChangeRequest::SwitchDown { name: spine },
                5 => ChangeRequest::SwitchUp { name: spine },
                6 => ChangeRequest::LinkFlap {
                    a,
                    b,
                    index: None,
                    down_ns: ms(rng),
                    up_ns: ms(rng),
                    count: 1 + rng.below(3),
                },
                7 => ChangeRequest::Partition {
                    groups: vec![vec![format!("gpu{}", rng.below(4))]],
                },
                8 => ChangeRequest::Heal,
                9 => ChangeRequest::GpuDown {
                    name: "gpu0".into(),
                },
                _ => ChangeRequest::GpuUp {
                    name: "gpu0".into(),
                },
            }
        };
        for _ in 0..200 {
            match rng.below(6) {
                0 | 1 => {
                    let req = random(&mut rng);
                    let _ = dp.change(&req);
                }
                2 | 3 => {
                    let items: Vec<(u64, ChangeRequest)> = (0..1 + rng.below(3))
                        .map(|_| (rng.below(4) as u64 * 1_000_000, random(&mut rng)))
                        .collect();
                    let faults: Vec<u32> = items.iter().map(|_| rng.below(3)).collect();
                    let _ = dp.schedule_faults(&items, &faults);
                }
                4 => {
                    let t = rng.below(dp.timelines as u32 + 1) as u64;
                    dp.cancel((rng.below(5) != 0).then_some(t));
                }
                _ => {
                    // gpu0's host sets its interface down or up.
                    let state = match rng.below(3) {
                        0 => IfState::Up,
                        1 => IfState::Down,
                        _ => IfState::NoCarrier,
                    };
                    dp.ports.links.push((0, HostLink::State(state)));
                }
            }
            let until = dp.ports.elapsed + StdDuration::from_micros(rng.below(3_000) as u64);
            step_to(&mut dp, until);
            for l in 0..t.links.len() as u32 {
                let up = dp.model.changed_links().iter().all(|c| c.link != l || c.up);
                assert_eq!(up, !dp.layers.held_down(l), "seed {seed}: link {l}");
                for end in 0..2 {
                    let model = &dp.model;
                    let want = dp
                        .layers
                        .expected(l, end, |l, e| model.original_of(PortId(2 * l + e as u32)));
                    let port = PortId(2 * l + end as u32);
                    assert_eq!(dp.model.link_of(port), want.0, "seed {seed}: link {l}");
                    checked += 1;
                }
            }
        }
        // A reset leaves what gpu0's host did; its up undoes it.
        dp.change(&ChangeRequest::Reset).unwrap();
        let host_holds = dp.status().changed_links.iter().all(|l| l.down_by_host);
        assert!(host_holds, "seed {seed}: {:?}", dp.status().changed_links);
        dp.ports.links.push((0, HostLink::State(IfState::Up)));
        dp.step();
        assert!(dp.status().changed_links.is_empty(), "seed {seed}");
        assert!(dp.status().partition.is_empty(), "seed {seed}");
        assert!(dp.layers.is_empty(), "seed {seed}");
    }
    assert!(checked > 10_000);
}

/// Schedules scenario `text` (checked against `t`) on `dp`: its timeline.
fn run_scenario(dp: &mut DataPlane<MemPorts>, t: &Topology, text: &str) -> u64 {
    let scenario = crate::scenario::parse(text, "s.toml", t).unwrap();
    dp.schedule_faults(&scenario.items, &scenario.faults)
        .unwrap()
        .0
}

/// Random faults of one scenario that overlap: while a random spine failure lasts,
/// every link of that spine stays down, whatever the random link flaps over its links
/// do; and the fabric is whole at the end.
#[test]
fn random_faults_of_one_scenario_overlap_faithfully() {
    let (mut dp, t) = plane(LS);
    let timeline = run_scenario(
        &mut dp,
        &t,
        "seed = 3\n[[random]]\ndo = \"switch-flap\"\nswitches = \"spine\"\nmtbf = \"2ms\"\nmttr = \"1ms\"\nuntil = \"30ms\"\n\
         [[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"500us\"\nmttr = \"200us\"\nuntil = \"30ms\"\n",
    );
    let spine_links = |spine: &str| -> Vec<u32> {
        (0..t.links.len() as u32)
            .filter(|&l| chaos::link_name(&t, l).contains(spine))
            .collect()
    };
    let (mut seen, mut checked, mut held) = (0, 0, 0);
    let mut dead = std::collections::BTreeSet::new();
    while dp.ports.elapsed < StdDuration::from_millis(40) {
        dp.step();
        for e in &dp.events[seen..] {
            for spine in ["spine0", "spine1"] {
                if e.what.starts_with(&format!("switch {spine} down")) {
                    dead.insert(spine);
                }
                if e.what.starts_with(&format!("switch {spine} up")) {
                    dead.remove(spine);
                }
            }
            // A link flap's return under a dead spine names the spine; a spine's
            // return with one of its links failed names a link failure.
            if let Some(rest) = e.what.strip_suffix(&format!(" of timeline {timeline})")) {
                match rest.split_once(" up (held down by switch ") {
                    Some((link, by)) => {
                        assert!(dead.contains(by), "{}: {by} is not down", e.what);
                        assert!(link.contains(by), "{}", e.what);
                    }
                    None => assert!(
                        e.what.starts_with("switch ")
                            && rest.ends_with(" held down by a link failure"),
                        "{}",
                        e.what
                    ),
                }
                held += 1;
            }
        }
        seen = dp.events.len();
        let down: Vec<u32> = dp
            .status()
            .changed_links
            .iter()
            .filter(|l| !l.up)
            .map(|l| l.id)
            .collect();
        for spine in &dead {
            for l in spine_links(spine) {
                assert!(down.contains(&l), "{spine} is down, its link {l} is up");
                checked += 1;
            }
        }
    }
    assert!(
        checked > 0 && held > 0,
        "the faults overlapped: {checked}, {held}"
    );
    assert_eq!(dp.status().pending_changes, 0);
    assert!(dp.status().changed_links.is_empty());
    assert!(dp.layers.is_empty());
}

/// A scenario's own steps (`[[event]]`s) that overlap: a link down, then its spine,
/// then the link up: the link stays down until the spine is back (the link's up undoes
/// the link's down only). And a spine's up does not bring up a link its leaf's failure
/// holds down.
#[test]
fn a_scenarios_own_steps_overlap_faithfully() {
    let (mut dp, t) = plane(LS);
    let timeline = run_scenario(
        &mut dp,
        &t,
        "[[event]]\nat = \"1ms\"\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n\
         [[event]]\nat = \"2ms\"\ndo = \"switch-down\"\nname = \"spine0\"\n\
         [[event]]\nat = \"3ms\"\ndo = \"link-up\"\na = \"leaf0\"\nb = \"spine0\"\n\
         [[event]]\nat = \"4ms\"\ndo = \"switch-down\"\nname = \"leaf0\"\n\
         [[event]]\nat = \"5ms\"\ndo = \"switch-up\"\nname = \"spine0\"\n\
         [[event]]\nat = \"6ms\"\ndo = \"switch-up\"\nname = \"leaf0\"\n",
    );
    let link = (0..t.links.len() as u32)
        .find(|&l| chaos::link_name(&t, l) == "leaf0-spine0 #0")
        .unwrap();
    let down = |dp: &mut DataPlane<MemPorts>| {
        dp.status()
            .changed_links
            .iter()
            .any(|l| l.id == link && !l.up)
    };
    let at = |dp: &mut DataPlane<MemPorts>, us: u64| {
        step_to(dp, StdDuration::from_micros(us));
        down(dp)
    };
    assert!(at(&mut dp, 1_500), "the link's own down");
    assert!(at(&mut dp, 3_500), "the link came up under its dead spine");
    let held =
        format!("link leaf0-spine0 #0 up (held down by switch spine0 of timeline {timeline})");
    assert!(dp.events.iter().any(|e| e.what == held), "{:#?}", dp.events);
    assert!(at(&mut dp, 5_500), "the link came up under its dead leaf");
    let held = format!("(1 of 2 held down by switch leaf0 of timeline {timeline})");
    assert!(said(&dp, "switch spine0 up", &held), "{:#?}", dp.events);
    assert!(!at(&mut dp, 6_500), "both ends back: the link is up");
    assert!(dp.status().changed_links.is_empty());
    assert!(dp.layers.is_empty());
}

/// A link a scenario's own `link-down` step holds is said to be held by that step (it was
/// "another fault of timeline 1", as for faults nobody named).
#[test]
fn a_hold_of_a_scenarios_own_link_step_is_named() {
    let (mut dp, t) = plane(LS);
    let timeline = run_scenario(
        &mut dp,
        &t,
        "[[event]]\nat = \"1ms\"\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n\
         [[event]]\nat = \"2ms\"\ndo = \"switch-down\"\nname = \"spine0\"\n\
         [[event]]\nat = \"3ms\"\ndo = \"switch-up\"\nname = \"spine0\"\n",
    );
    step_to(&mut dp, StdDuration::from_micros(3_500));
    let held = format!("(1 of 2 held down by a link-down step of timeline {timeline})");
    assert!(said(&dp, "switch spine0 up", &held), "{:#?}", dp.events);
}

#[test]
fn a_switch_going_down_is_one_event_that_says_what_was_down_already() {
    let (mut dp, _t) = plane(LS);
    let links_down =
        |dp: &mut DataPlane<MemPorts>| dp.status().changed_links.iter().filter(|l| !l.up).count();
    let one = ChangeRequest::LinkDown {
        a: "leaf0".into(),
        b: "spine0".into(),
        index: None,
    };
    assert_eq!(dp.change(&one).unwrap().len(), 1);
    let spine = ChangeRequest::SwitchDown {
        name: "spine0".into(),
    };
    let events = dp.change(&spine).unwrap();
    let what: Vec<&str> = events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        what,
        ["switch spine0 down (2 links, to leaf0, leaf1) (1 of 2 already so)"]
    );
    assert_eq!(links_down(&mut dp), 2, "every link of spine0");
    let events = dp.change(&spine).unwrap();
    assert!(events[0].what.ends_with(") (already so)"), "{events:?}");
    let up = ChangeRequest::SwitchUp {
        name: "spine0".into(),
    };
    assert_eq!(
        dp.change(&up).unwrap()[0].what,
        "switch spine0 up (2 links, to leaf0, leaf1)"
    );
    assert_eq!(links_down(&mut dp), 0);
    assert_eq!(dp.status().events, 4, "one event per request");
    // What may be pending is counted in the model's changes, a link each here.
    let many: Vec<(u64, ChangeRequest)> = (0..MAX_PENDING as u64 / 2 + 1)
        .map(|i| (1_000 + i, spine.clone()))
        .collect();
    let e = dp.schedule(&many).unwrap_err();
    assert_eq!(
        e,
        format!(
            "{} changes would be pending; at most {MAX_PENDING} may be",
            MAX_PENDING + 2
        )
    );
    assert_eq!(dp.status().pending_changes, 0);
}

#[test]
fn a_timeline_is_checked_whole_and_can_be_cancelled() {
    let (mut dp, _t) = plane(LS);
    let down = |b: &str| ChangeRequest::LinkDown {
        a: "leaf0".into(),
        b: b.into(),
        index: None,
    };
    let e = dp
        .schedule(&[(1_000, down("spine0")), (2_000, down("spine9"))])
        .unwrap_err();
    assert!(
        e.starts_with("change 2 of 2: no GPU or switch \"spine9\""),
        "{e}"
    );
    assert_eq!(dp.status().pending_changes, 0, "none of it");
    let (a, _) = dp.schedule(&[(1_000_000, down("spine0"))]).unwrap();
    let (b, _) = dp.schedule(&[(1_000_000, down("spine1"))]).unwrap();
    assert_ne!(a, b);
    assert_eq!(dp.cancel(Some(a)).0, 1);
    assert_eq!(dp.status().pending_changes, 1);
    assert_eq!(dp.cancel(None).0, 1);
    let e = dp
        .change(&ChangeRequest::LoadStop { id: None })
        .unwrap_err();
    assert_eq!(e, "no load is running");
}

/// `load --stop ID` says what became of a load: running (stopped), one a scenario starts
/// later (which timeline), one done (also once the model has let it go), one never
/// given.
#[test]
fn stopping_a_load_says_what_became_of_it() {
    let (mut dp, _t) = plane(LS);
    let load = |for_ns| ChangeRequest::Load {
        from: "leaf0".into(),
        to: "leaf1".into(),
        rate_bps: 1_000_000,
        packet_bytes: None,
        for_ns,
        on_ns: None,
        off_ns: None,
    };
    let s = 1_000_000_000;
    // Load 1 runs; load 2 starts in a second, in timeline 1.
    dp.change(&load(None)).unwrap();
    let (timeline, _) = dp.schedule(&[(s, load(Some(s)))]).unwrap();
    let stop =
        |dp: &mut DataPlane<MemPorts>, id| dp.change(&ChangeRequest::LoadStop { id: Some(id) });
    assert_eq!(
        stop(&mut dp, 2).unwrap_err(),
        format!(
            "load 2 has not started yet: its scenario starts it later (`closbox cancel {timeline}` ends the scenario)"
        )
    );
    assert!(stop(&mut dp, 1).is_ok());
    assert_eq!(
        stop(&mut dp, 1).unwrap_err(),
        "load 1 is not running any more"
    );
    assert_eq!(
        stop(&mut dp, 7).unwrap_err(),
        "no load 7; no load is running"
    );
    // Beyond the loads the model keeps once done, the first is let go and still known.
    dp.cancel(None);
    use closbox_fabric::model::KEPT_DONE_LOADS;
    for i in 0..KEPT_DONE_LOADS as u64 + 1 {
        // Time for what it sent to leave the fabric (a load holding packets stays).
        step_to(&mut dp, StdDuration::from_millis(i + 1));
        dp.change(&load(None)).unwrap();
        dp.change(&ChangeRequest::LoadStop { id: None }).unwrap();
    }
    assert!(
        !dp.model.loads().iter().any(|l| l.spec.id == 1),
        "let go by the model"
    );
    let st = dp.status();
    assert!(st.loads.iter().all(|l| l.id > 3), "{:?}", st.loads);
    // Load 1 and those 65 (load 2 never started), 20 of them listed.
    assert_eq!(
        st.loads_earlier.loads as usize,
        1 + KEPT_DONE_LOADS + 1 - 20
    );
    assert_eq!(
        stop(&mut dp, 1).unwrap_err(),
        "load 1 is not running any more"
    );
}

/// `reset` undoes everything at once, as one event that says what it took, and forgets
/// what was set by hand; a second one has nothing to undo.
#[test]
fn a_reset_puts_the_fabric_back_as_its_topology_made_it() {
    let (mut dp, _t) = plane(LS);
    let link = |b: &str| ("leaf0".to_owned(), b.to_owned());
    let (a, b) = link("spine0");
    dp.change(&ChangeRequest::LinkDown { a, b, index: None })
        .unwrap();
    let (a, b) = link("spine1");
    dp.change(&ChangeRequest::LinkSet {
        a,
        b,
        index: None,
        rate_bps: Some(100_000_000),
        delay_ns: None,
        loss: Some(0.1),
        loss_burst: None,
        buffer_bytes: None,
        from: None,
    })
    .unwrap();
    dp.change(&ChangeRequest::Partition {
        groups: vec![vec!["gpu0".into()]],
    })
    .unwrap();
    dp.change(&ChangeRequest::Load {
        from: "leaf0".into(),
        to: "leaf1".into(),
        rate_bps: 1_000_000,
        packet_bytes: None,
        for_ns: None,
        on_ns: None,
        off_ns: None,
    })
    .unwrap();
    let s = 1_000_000_000;
    let (a, b) = link("spine1");
    let flap = ChangeRequest::LinkFlap {
        a,
        b,
        index: None,
        down_ns: s,
        up_ns: s,
        count: 2,
    };
    dp.schedule(&[(s, flap.clone())]).unwrap();
    dp.change(&flap).unwrap();
    assert_eq!(dp.status().pending_changes, 7);
    let e = dp.change(&ChangeRequest::Reset).unwrap();
    assert_eq!(
        e[0].what,
        "fabric reset: 2 links up, 1 link reset to the topology's values, partition healed, \
         1 load stopped, 7 pending steps dropped (1 timeline cancelled)"
    );
    let st = dp.status();
    assert!(st.changed_links.is_empty(), "{:?}", st.changed_links);
    assert!(st.partition.is_empty());
    assert!(st.loads.iter().all(|l| !l.active));
    assert!(st.timelines.is_empty());
    assert_eq!(st.pending_changes, 0);
    assert!(dp.layers.is_empty());
    // A scenario whose changes are all made but whose load still runs.
    let load = ChangeRequest::Load {
        from: "leaf0".into(),
        to: "leaf1".into(),
        rate_bps: 1_000_000,
        packet_bytes: None,
        for_ns: Some(10 * s),
        on_ns: None,
        off_ns: None,
    };
    dp.schedule(&[(0, load)]).unwrap();
    let e = dp.change(&ChangeRequest::Reset).unwrap();
    assert_eq!(
        e[0].what,
        "fabric reset: 1 load stopped, 1 timeline cancelled"
    );
    assert!(ends_early(&e[0].what, 2));
    let e = dp.change(&ChangeRequest::Reset).unwrap();
    assert_eq!(e[0].what, "fabric reset: nothing to undo");
}

/// A scenario's reset (a degrade's repair, made at once by a cancel too) returns a
/// link set by hand to the values set by hand, direction by direction, not to the
/// topology's; a reset by hand forgets them.
#[test]
fn a_scenario_reset_returns_a_link_to_what_was_set_by_hand() {
    use closbox_fabric::routing::PortId;
    let (mut dp, _t) = plane(LS);
    let set =
        |rate_bps: Option<u64>, loss: Option<f64>, from: Option<&str>| ChangeRequest::LinkSet {
            a: "gpu0".into(),
            b: "leaf0".into(),
            index: None,
            rate_bps,
            delay_ns: None,
            loss,
            loss_burst: None,
            buffer_bytes: from.map(|_| 64_000),
            from: from.map(Into::into),
        };
    let reset = || ChangeRequest::LinkReset {
        a: "gpu0".into(),
        b: "leaf0".into(),
        index: None,
    };
    // By hand: the gpu0→leaf0 direction at 100 Mbit/s with a 64 kB buffer.
    dp.change(&set(Some(100_000_000), None, Some("gpu0")))
        .unwrap();
    let l = dp.status().changed_links[0].id;
    let (gpu_end, leaf_end) = (PortId(2 * l), PortId(2 * l + 1));
    let hand = (dp.model.link_of(gpu_end), dp.model.link_of(leaf_end));
    assert_eq!(hand.0.rate.bps(), 100_000_000);
    assert_eq!(hand.1.rate.bps(), 1_000_000_000);
    let s = 1_000_000_000;
    let degrade = |dp: &mut DataPlane<MemPorts>| {
        let (t, _) = dp
            .schedule(&[(0, set(Some(10_000_000), Some(0.5), None)), (s, reset())])
            .unwrap();
        assert_eq!(dp.model.link_of(gpu_end).rate.bps(), 10_000_000);
        assert_eq!(dp.model.link_of(leaf_end).loss, 0.5);
        let (_, repaired) = dp.cancel(Some(t));
        assert_eq!(repaired.len(), 1);
        repaired[0].what.clone()
    };
    let what = degrade(&mut dp);
    assert_eq!(
        what,
        "link gpu0-leaf0 #0 reset to the values set by hand (now: timeline 1 cancelled)"
    );
    assert_eq!(
        (dp.model.link_of(gpu_end), dp.model.link_of(leaf_end)),
        hand
    );
    let buffers = dp.status().changed_links[0].buffer_bytes;
    assert_eq!(buffers[0], 64_000, "{buffers:?}");
    // A set by hand during a degrade changes what the repair returns to, with what it
    // sets only: the degrade's loss is not taken for the link's own.
    let (t, _) = dp
        .schedule(&[(0, set(None, Some(0.5), None)), (s, reset())])
        .unwrap();
    dp.change(&set(Some(200_000_000), None, None)).unwrap();
    dp.cancel(Some(t));
    assert_eq!(dp.model.link_of(gpu_end).rate.bps(), 200_000_000);
    assert_eq!(dp.model.link_of(leaf_end).rate.bps(), 200_000_000);
    assert_eq!(dp.model.link_of(gpu_end).loss, 0.0);
    // Reset by hand: the topology's values, to which a scenario's reset returns too.
    dp.change(&reset()).unwrap();
    assert!(dp.status().changed_links.is_empty());
    let what = degrade(&mut dp);
    assert!(what.contains("reset to the topology's values"), "{what}");
    assert!(dp.status().changed_links.is_empty());
}

/// Faults of several timelines on one link are undone one by one: a degrade's repair
/// leaves another timeline's degrade in place, a flap's "up" leaves a link down while
/// its switch is down.
#[test]
fn overlapping_faults_are_undone_one_by_one() {
    use closbox_fabric::routing::PortId;
    let (mut dp, _t) = plane(LS);
    let set = |rate_bps: Option<u64>, loss: Option<f64>| ChangeRequest::LinkSet {
        a: "leaf0".into(),
        b: "spine0".into(),
        index: None,
        rate_bps,
        delay_ns: None,
        loss,
        loss_burst: None,
        buffer_bytes: None,
        from: None,
    };
    let reset = || ChangeRequest::LinkReset {
        a: "leaf0".into(),
        b: "spine0".into(),
        index: None,
    };
    let s = 1_000_000_000;
    // A schedule refused takes no timeline id.
    assert!(dp.schedule(&[(0, set(Some(0), None))]).is_err());
    let (one, _) = dp
        .schedule(&[(0, set(Some(500_000_000), None)), (10 * s, reset())])
        .unwrap();
    assert_eq!(one, 1);
    let (two, _) = dp
        .schedule(&[(0, set(None, Some(0.25))), (20 * s, reset())])
        .unwrap();
    let l = dp.status().changed_links[0].id;
    let link = |dp: &DataPlane<MemPorts>| dp.model.link_of(PortId(2 * l));
    assert_eq!((link(&dp).rate.bps(), link(&dp).loss), (500_000_000, 0.25));
    let (_, repaired) = dp.cancel(Some(one));
    assert_eq!(
        repaired[0].what,
        format!(
            "link leaf0-spine0 #0 reset to the topology's values \
             (now: timeline {one} cancelled) (still degraded by timeline {two})"
        )
    );
    assert!(ends_early(&repaired[0].what, one));
    assert_eq!(
        (link(&dp).rate.bps(), link(&dp).loss),
        (1_000_000_000, 0.25)
    );
    dp.cancel(Some(two));
    assert!(dp.status().changed_links.is_empty());
    // A switch down for one timeline; another flaps one of its links: the flap's "up"
    // leaves the link down, and the switch's own "up" brings every link back.
    let (_, now) = dp
        .schedule(&[
            (
                0,
                ChangeRequest::SwitchDown {
                    name: "spine0".into(),
                },
            ),
            (
                10 * s,
                ChangeRequest::SwitchUp {
                    name: "spine0".into(),
                },
            ),
        ])
        .unwrap();
    let down = dp.status().changed_links.len();
    assert!(
        now[0].what.starts_with("switch spine0 down"),
        "{}",
        now[0].what
    );
    let (flap, now) = dp
        .schedule(&[(
            0,
            ChangeRequest::LinkFlap {
                a: "leaf0".into(),
                b: "spine0".into(),
                index: None,
                down_ns: s / 1000,
                up_ns: s / 1000,
                count: 1,
            },
        )])
        .unwrap();
    assert_eq!(
        now[0].what,
        "link leaf0-spine0 #0 down (flap 1 of 1) (already so)"
    );
    step_to(&mut dp, StdDuration::from_millis(3));
    let log: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
    assert!(
        log.contains(&"link leaf0-spine0 #0 up (flap 1 of 1) (held down by timeline 3)"),
        "timeline {flap}: {log:?}"
    );
    let changed = dp.status().changed_links;
    assert_eq!(changed.len(), down);
    assert!(changed.iter().all(|l| l.down_by == [3]), "{changed:?}");
    dp.cancel(None);
    assert!(dp.status().changed_links.is_empty());
    // Two partitions: both in place, then the first's heal leaves the second's.
    let cut = |gpus: &[&str]| ChangeRequest::Partition {
        groups: vec![gpus.iter().map(|g| g.to_string()).collect()],
    };
    let (halves, _) = dp
        .schedule(&[(0, cut(&["gpu0", "gpu1"])), (10 * s, ChangeRequest::Heal)])
        .unwrap();
    let (lone, now) = dp
        .schedule(&[(0, cut(&["gpu3"])), (10 * s, ChangeRequest::Heal)])
        .unwrap();
    assert_eq!(
        now[0].what,
        format!("partition gpu3 | the rest (with the partition by timeline {halves})")
    );
    assert_eq!(dp.status().partition.len(), 3);
    let (_, repaired) = dp.cancel(Some(halves));
    assert_eq!(
        repaired[0].what,
        format!(
            "heal: partition removed (now: timeline {halves} cancelled) \
             (partition by timeline {lone} stays)"
        )
    );
    assert_eq!(
        dp.status().partition,
        [vec!["gpu3"], vec!["gpu0", "gpu1", "gpu2"]]
    );
    dp.cancel(Some(lone));
    assert!(dp.status().partition.is_empty());
    assert!(dp.layers.is_empty());
}

/// A timeline cancelled in the middle repairs at once what it broke and would have
/// repaired, drops the faults still to come, and leaves alone what others broke.
#[test]
fn a_cancelled_timeline_repairs_what_it_broke() {
    let (mut dp, _t) = plane(LS);
    let down = |b: &str| ChangeRequest::LinkDown {
        a: "leaf0".into(),
        b: b.into(),
        index: None,
    };
    let up = |b: &str| ChangeRequest::LinkUp {
        a: "leaf0".into(),
        b: b.into(),
        index: None,
    };
    let load = |for_ns| ChangeRequest::Load {
        from: "leaf0".into(),
        to: "leaf1".into(),
        rate_bps: 1_000_000,
        packet_bytes: None,
        for_ns: Some(for_ns),
        on_ns: None,
        off_ns: None,
    };
    // Down by hand: the timeline's later "up" of it is not its repair to make.
    dp.change(&down("spine1")).unwrap();
    let slow = ChangeRequest::LinkSet {
        a: "gpu0".into(),
        b: "leaf0".into(),
        index: None,
        rate_bps: Some(1_000_000),
        delay_ns: None,
        loss: None,
        loss_burst: None,
        buffer_bytes: None,
        from: None,
    };
    let reset = ChangeRequest::LinkReset {
        a: "gpu0".into(),
        b: "leaf0".into(),
        index: None,
    };
    let s = 1_000_000_000;
    let (t, now) = dp
        .schedule(&[
            (0, load(10 * s)),
            (0, down("spine0")),
            (0, slow),
            (s, up("spine0")),
            (2 * s, down("spine0")),
            (3 * s, up("spine0")),
            (3 * s, reset),
            (3 * s, up("spine1")),
            (4 * s, down("spine1")),
        ])
        .unwrap();
    assert_eq!(now.len(), 3);
    assert_eq!(dp.status().changed_links.len(), 3);
    assert_eq!(
        dp.status().timelines,
        [TimelineStatus {
            id: t,
            pending: 6,
            loads: vec![1],
            waiting: None,
        }]
    );
    let (dropped, repaired) = dp.cancel(Some(t));
    assert_eq!(dropped, 6);
    // Each is the timeline's event, as is the line saying it was cancelled.
    assert!(
        repaired.iter().all(|e| e.timeline == Some(t)),
        "{repaired:?}"
    );
    let last = dp.events.len() - repaired.len() - 1;
    assert_eq!(dp.events[last].timeline, Some(t), "{:?}", dp.events[last]);
    let what: Vec<&str> = repaired.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        what,
        [
            format!("link leaf0-spine0 #0 up (now: timeline {t} cancelled)"),
            format!(
                "link gpu0-leaf0 #0 reset to the topology's values (now: timeline {t} cancelled)"
            ),
            format!("load 1 stopped (now: timeline {t} cancelled)"),
        ]
    );
    // The log says the timeline ended, and with how much to come, before the repairs.
    let log: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
    let at = log
        .iter()
        .position(|w| *w == format!("timeline {t} cancelled with 6 steps pending"))
        .expect("the cancel is logged");
    assert_eq!(log[at + 1], what[0]);
    assert!(log[at..].iter().all(|w| ends_early(w, t)), "{log:?}");
    assert!(!log[..at].iter().any(|w| ends_early(w, t)), "{log:?}");
    assert!(dp.status().loads.iter().all(|l| !l.active));
    assert!(dp.status().timelines.is_empty());
    let changed = dp.status().changed_links;
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].ends, ["leaf0", "spine1"]);
    assert_eq!(dp.status().pending_changes, 0);
    assert!(dp.broken.is_empty());
    // A timeline's "up" of a link down by hand leaves it down: the hand holds it.
    let (t, now) = dp.schedule(&[(0, up("spine1"))]).unwrap();
    assert_eq!(
        now[0].what, "link leaf0-spine1 #0 up (held down by hand)",
        "timeline {t}"
    );
    assert_eq!(dp.status().changed_links.len(), 1);
    dp.change(&up("spine1")).unwrap();
    // A timeline run to its end keeps nothing: its changes applied, its load ended
    // (logged as the timeline's; changes by hand are nobody's).
    assert_eq!(dp.events.last().map(|e| e.timeline), Some(None));
    let (t, _) = dp
        .schedule(&[(0, load(100_000)), (1, down("spine1")), (2, up("spine1"))])
        .unwrap();
    assert_eq!(dp.status().timelines.len(), 1);
    step_to(&mut dp, StdDuration::from_millis(1));
    assert_eq!(dp.status().pending_changes, 0);
    assert!(dp.broken.is_empty());
    assert!(dp.status().changed_links.is_empty());
    let done = dp.events.iter().find(|e| e.what.starts_with("load 2 done"));
    assert_eq!(done.map(|e| e.timeline), Some(Some(t)), "{:?}", dp.events);
    assert!(dp.load_timelines.is_empty());
}

/// The real-time valve: out of the FIFO class after running `RT_MAX_RUN` without
/// sleeping, back in when it sleeps, not before `RT_COOLDOWN`.
#[test]
fn the_realtime_valve_lets_go_of_a_busy_cpu() {
    let t0 = StdInstant::now();
    let at = |us: u64| t0 + StdDuration::from_micros(us);
    let mut rt = Realtime {
        on: true,
        slept: t0,
        fallbacks: 0,
        fell_back: None,
        refused: None,
    };
    // Busy (waits that return at once) for 10 ms: stays; past it: leaves.
    assert_eq!(rt.after_wait(at(5_000), at(5_001)), None);
    assert_eq!(rt.after_wait(at(9_998), at(9_999)), None);
    assert_eq!(rt.after_wait(at(10_001), at(10_002)), Some(false));
    rt.on = false;
    assert_eq!(rt.fallbacks, 1);
    // Sleeping again within the cool-down: stays out; after it: back in.
    assert_eq!(rt.after_wait(at(20_000), at(20_100)), None);
    let later = 10_002 + RT_COOLDOWN.as_micros() as u64;
    assert_eq!(
        rt.after_wait(at(later), at(later + 15)),
        None,
        "not a sleep"
    );
    assert_eq!(rt.after_wait(at(later), at(later + 30)), Some(true));
    rt.on = true;
    // A thread that sleeps now and then stays in.
    for i in 1..100u64 {
        let t = later + i * 5_000;
        assert_eq!(rt.after_wait(at(t), at(t + 100)), None);
    }
    // Refused: never asks again.
    rt.refused = Some("EPERM".into());
    assert_eq!(rt.after_wait(at(10_000_000), at(20_000_000)), None);
}

#[test]
fn advice_for_a_late_fabric_names_the_time_scale_to_try() {
    // leaf-spine-16's file at real time: plan's estimate for a full load is 5.
    let a = behind_advice(1.0, 5.0, None, false, true);
    assert!(
        a.starts_with(
            "this box cannot keep up with the configured rates; raise time_scale to at least 5 "
        ),
        "{a}"
    );
    // Already at or above the estimate (8 gloo ranks on leaf-spine-16 were still late
    // at 5, on time at 20): the traffic costs more than the estimate assumes.
    let a = behind_advice(10.0, 5.0, None, false, true);
    assert!(
        a.starts_with(
            "this box cannot keep up with the configured rates; raise time_scale above 10 "
        ),
        "{a}"
    );
    assert!(a.contains("estimated 5 for every GPU"), "{a}");
    // From a daemon that did not say.
    let a = behind_advice(1.0, 0.0, None, false, true);
    assert!(
        a.ends_with("; raise time_scale (`up --time-scale auto` measures what this box needs), or lower the rates"),
        "{a}"
    );
    let (p, _) = plane(TWO);
    assert_eq!(p.full_load, 1.0, "2 GPUs of 1 Gbit/s: real time holds");
}

#[test]
fn a_thread_kept_off_its_cpu_is_told_to_use_realtime_a_busy_one_time_scale() {
    let use_of = |busy: f64, waited_ms: f64| CpuUse {
        window_s: 5.0,
        busy,
        peak_busy: busy,
        waited_ms,
        steal: 0.0,
    };
    // One flow at a third of the box's speed, normal class (measured: 68 % busy,
    // 115 ms waiting, p99 lateness 0.7 ms).
    let waited = use_of(0.68, 115.0);
    assert!(waited.preempted());
    let a = behind_advice(1.0, 5.0, Some(&waited), false, true);
    assert!(
        a.contains("busy only 68 % of a CPU but waited 115 ms"),
        "{a}"
    );
    assert!(a.contains("`closbox up --realtime`"), "{a}");
    // Already asked for: the time-scale advice.
    let a = behind_advice(1.0, 5.0, Some(&waited), true, true);
    assert!(
        a.starts_with(
            "this box cannot keep up with the configured rates; raise time_scale to at least 5 "
        ),
        "{a}"
    );
    // Saturated (it waited too, but it had no time to spare), or bursts beyond the
    // box's speed (13 ms waiting): the work is the cause.
    // A job that saturated it for a while and ended (8 gloo ranks: busy 40 % over
    // the window, 58 ms waiting): work-bound too.
    let ended = CpuUse {
        peak_busy: 0.99,
        ..use_of(0.4, 58.0)
    };
    for c in [use_of(0.98, 200.0), use_of(0.66, 13.0), ended] {
        assert!(!c.preempted(), "{c:?}");
        let a = behind_advice(1.0, 5.0, Some(&c), false, true);
        assert!(a.starts_with("this box cannot keep up with the configured rates; raise time_scale to at least 5 "), "{a}");
    }
    // The hypervisor took a fifth of the CPUs (measured: the thread busy 31 %, 56 ms
    // waiting, p99 9 ms): named before the scheduler or the work, `--realtime` or not.
    let stolen = CpuUse {
        steal: 0.2,
        ..use_of(0.31, 56.0)
    };
    for realtime in [false, true] {
        let a = behind_advice(20000.0, 5000.0, Some(&stolen), realtime, false);
        assert!(
            a.starts_with(
                "the hypervisor gave this machine's CPUs to others for 20 % of the last 5.0 s"
            ),
            "{a}"
        );
        assert!(a.ends_with("): raise time_scale (the same wall-clock delays then shift fabric time less), or run on a quieter host"), "{a}");
    }
    // Where idle CPUs halt and `--idle-poll` would have them poll, that comes first: on a
    // VM most of what the host takes is the time to run a halted CPU again.
    let a = behind_advice(20000.0, 5000.0, Some(&stolen), false, true);
    assert!(
        a.contains("): `closbox up --idle-poll` (its idle CPUs then poll instead of halting"),
        "{a}"
    );
    let a = behind_advice(
        1.0,
        5.0,
        Some(&CpuUse {
            steal: 0.02,
            ..waited
        }),
        false,
        true,
    );
    assert!(a.contains("busy only 68 % of a CPU"), "{a}");
}

#[test]
fn cpu_use_is_taken_from_samples_over_the_window_and_its_busiest_slot() {
    let t0 = StdInstant::now();
    let at = |ms: u64| t0 + StdDuration::from_millis(ms);
    let sample = |wall, run_ns, wait_ns, box_ticks| CpuSample {
        wall,
        run_ns,
        wait_ns,
        box_ticks,
    };
    let slot = StdDuration::from_millis(250);
    let c = CpuUse::of(
        &[
            sample(at(0), 1_000, 50, (10_000, 100)),
            sample(at(5000), 2_500_001_000, 60_000_050, (11_000, 150)),
        ],
        slot,
    );
    assert_eq!(c.window_s, 5.0);
    assert!((c.busy - 0.5).abs() < 1e-6, "{c:?}");
    assert!((c.peak_busy - 0.5).abs() < 1e-6, "{c:?}");
    assert_eq!(c.waited_ms, 60.0);
    assert!((c.steal - 0.05).abs() < 1e-12, "{c:?}");
    assert!(c.preempted());
    // The same CPU time in its first half second: saturated then, work-bound.
    let c = CpuUse::of(
        &[
            sample(at(0), 0, 0, (0, 0)),
            sample(at(500), 480_000_000, 10_000_000, (0, 0)),
            sample(at(4900), 2_500_000_000, 60_000_000, (0, 0)),
            // A short last interval does not count as a slot.
            sample(at(5000), 2_600_000_000, 60_000_000, (0, 0)),
        ],
        slot,
    );
    assert!((c.busy - 0.52).abs() < 1e-6, "{c:?}");
    assert!((c.peak_busy - 0.96).abs() < 1e-6, "{c:?}");
    assert!(!c.preempted(), "{c:?}");
}

#[test]
fn shortest_gpu_path_is_through_one_leaf_or_one_link() {
    // GPU → leaf (100 ns + 600 ns of switch) → GPU (100 ns); spines are further.
    let ls = "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\ndelay = \"100ns\"\n[links.leaf-spine]\ndelay = \"500ns\"\n[switches.leaf]\nlatency = \"600ns\"\n";
    assert_eq!(shortest(ls), 800);
    let mesh = "[topology]\nkind = \"full-mesh\"\ngpus = 3\n[links.nic]\ndelay = \"2us\"\n";
    assert_eq!(shortest(mesh), 2000);
}

#[test]
fn a_gpu_whose_host_sets_its_interface_down_has_its_links_down_until_it_sets_it_up() {
    let (mut dp, t) = plane(TWO);
    dp.ports.links = vec![(1, HostLink::State(IfState::Down))];
    dp.step();
    let st = dp.status();
    assert_eq!(st.changed_links.len(), 1);
    let l = &st.changed_links[0];
    assert!(!l.up && l.down_by_host && l.down_by.is_empty(), "{l:?}");
    // Frames to it are dropped where the fabric would, as a link down, and what it
    // would still send (a TUN moved elsewhere and set up) enters nothing.
    dp.ports.inbox[0].push_back((StdDuration::from_micros(5), udp(&t, 0, 1, 500)));
    dp.ports.inbox[1].push_back((StdDuration::from_micros(6), udp(&t, 1, 0, 500)));
    for _ in 0..1000 {
        dp.step();
    }
    assert!(dp.ports.sent.is_empty());
    let drops: std::collections::BTreeMap<String, u64> = dp.status().drops.into_iter().collect();
    assert_eq!(drops["link_down"], 2, "{drops:?}");
    // Neither the hand nor a reset brings it up; the host does.
    let up = dp.change(&ChangeRequest::GpuUp {
        name: "gpu1".into(),
    });
    assert!(up.unwrap()[0]
        .what
        .ends_with("(held down by its GPU's host, whose interface is down)"));
    dp.change(&ChangeRequest::Reset).unwrap();
    assert!(!dp.status().changed_links[0].up);
    // Down by hand meanwhile: the host's up leaves it to the hand.
    dp.change(&ChangeRequest::GpuDown {
        name: "gpu1".into(),
    })
    .unwrap();
    dp.ports.links = vec![(1, HostLink::State(IfState::Up))];
    dp.step();
    assert!(!dp.status().changed_links[0].up);
    dp.change(&ChangeRequest::GpuUp {
        name: "gpu1".into(),
    })
    .unwrap();
    assert!(dp.status().changed_links.is_empty());
    // (Once routes have converged over it.)
    for _ in 0..1000 {
        dp.step();
    }
    dp.ports.inbox[0].push_back((dp.ports.elapsed, udp(&t, 0, 1, 500)));
    for _ in 0..1000 {
        dp.step();
    }
    assert_eq!(dp.ports.sent.len(), 1, "{:?}", dp.status().drops);
    // Deleted: down for good, said once.
    dp.ports.links = vec![
        (1, HostLink::State(IfState::Gone)),
        (1, HostLink::State(IfState::Up)),
    ];
    dp.step();
    assert!(!dp.status().changed_links[0].up);
    let whats: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
    let host: Vec<&str> = whats
        .iter()
        .copied()
        .filter(|w| w.contains("its host") || w.contains("is gone"))
        .collect();
    assert_eq!(
        host,
        [
            "gpu1's link down: its host set its interface down (held down until it sets it up)",
            "gpu1's link up: its host set its interface up (held down by hand)",
            "gpu1's link down for good: its interface is gone: deleted or moved out of its namespace, or its TUN failed; its links stay down until `closbox down`",
        ],
        "{whats:#?}"
    );
}

#[test]
fn a_gpu_whose_carrier_is_off_has_its_links_down_until_it_is_on() {
    let (mut dp, _t) = plane(TWO);
    let state = |dp: &mut DataPlane<MemPorts>, s| {
        dp.ports.links = vec![(1, HostLink::State(s))];
        dp.step();
        dp.status()
            .changed_links
            .iter()
            .all(|l| !l.up && l.down_by_host)
            && !dp.status().changed_links.is_empty()
    };
    assert!(state(&mut dp, IfState::NoCarrier));
    let how = |dp: &mut DataPlane<MemPorts>| dp.status().gpu_interfaces;
    assert_eq!(how(&mut dp), [("gpu1".to_owned(), "no-carrier".to_owned())]);
    // Set down as well, then up without its carrier: down all along.
    assert!(state(&mut dp, IfState::Down));
    assert_eq!(how(&mut dp), [("gpu1".to_owned(), "down".to_owned())]);
    assert!(state(&mut dp, IfState::NoCarrier));
    assert!(!state(&mut dp, IfState::Up));
    assert!(how(&mut dp).is_empty());
    let whats: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        whats,
        [
            "gpu1's link down: its host set its interface's carrier off (held down until it is on again)",
            "gpu1's interface is set down by its host (its links stay down)",
            "gpu1's interface is up, without its carrier (its links stay down)",
            "gpu1's link up: its interface's carrier is on again",
        ]
    );
}

#[test]
fn a_gpu_loses_its_carrier_while_all_its_links_are_down_and_not_by_its_host() {
    // 2 leaves of 2 GPUs, 2 spines.
    let (mut dp, _t) =
        plane("[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n");
    let apply = |dp: &mut DataPlane<MemPorts>, c: ChangeRequest| {
        dp.change(&c).unwrap();
        dp.step();
        std::mem::take(&mut dp.ports.carriers)
    };
    let gpu = |name: &str| name.to_owned();
    assert_eq!(
        apply(&mut dp, ChangeRequest::GpuDown { name: gpu("gpu1") }),
        [(1, false)]
    );
    assert_eq!(
        apply(&mut dp, ChangeRequest::GpuUp { name: gpu("gpu1") }),
        [(1, true)]
    );
    // Its leaf dead: both of its GPUs; a spine dead: none (their links are up).
    assert_eq!(
        apply(&mut dp, ChangeRequest::SwitchDown { name: gpu("leaf0") }),
        [(0, false), (1, false)]
    );
    assert!(apply(
        &mut dp,
        ChangeRequest::SwitchDown {
            name: gpu("spine0")
        }
    )
    .is_empty());
    assert_eq!(apply(&mut dp, ChangeRequest::Reset), [(0, true), (1, true)]);
    // A link that loses every frame is up: no NIC sees a gray failure.
    let lossy = ChangeRequest::LinkSet {
        a: gpu("gpu2"),
        b: gpu("leaf1"),
        index: None,
        rate_bps: None,
        delay_ns: None,
        loss: Some(1.0),
        loss_burst: None,
        buffer_bytes: None,
        from: None,
    };
    assert!(apply(&mut dp, lossy).is_empty());
    // Its host's carrier off is the same flag: the fabric leaves it to the host while it
    // holds it, through the fabric's own down and up.
    dp.ports.links = vec![(3, HostLink::State(IfState::NoCarrier))];
    dp.step();
    assert!(apply(&mut dp, ChangeRequest::GpuDown { name: gpu("gpu3") }).is_empty());
    assert!(apply(&mut dp, ChangeRequest::GpuUp { name: gpu("gpu3") }).is_empty());
    // Its host's carrier on while the fabric has its links down: off again.
    dp.change(&ChangeRequest::GpuDown { name: gpu("gpu3") })
        .unwrap();
    dp.ports.links = vec![(3, HostLink::State(IfState::Up))];
    dp.step();
    assert_eq!(std::mem::take(&mut dp.ports.carriers), [(3, false)]);
    // Set down by its host: off (it has no links up), and not said as the fabric's.
    dp.ports.links = vec![(2, HostLink::State(IfState::Down))];
    dp.step();
    assert_eq!(std::mem::take(&mut dp.ports.carriers), [(2, false)]);
    dp.ports.links = vec![(2, HostLink::State(IfState::Up))];
    dp.step();
    assert_eq!(std::mem::take(&mut dp.ports.carriers), [(2, true)]);
    let said: Vec<&str> = dp
        .events
        .iter()
        .map(|e| e.what.as_str())
        .filter(|w| w.contains("carrier"))
        .collect();
    assert_eq!(
        said,
        [
            "GPU gpu1 down (1 link, to leaf0); gpu1 lost its carrier (NO-CARRIER: none of its links is up)",
            "GPU gpu1 up (1 link, to leaf0); gpu1 got its carrier back",
            "switch leaf0 down (4 links, to gpu0, gpu1, spine0, spine1); gpu0 and gpu1 lost their carrier (NO-CARRIER: none of their links is up)",
            "fabric reset: 5 links up; gpu0 and gpu1 got their carrier back",
            "gpu3's link down: its host set its interface's carrier off (held down until it is on again)",
            "gpu3's link up: its interface's carrier is on again (held down by hand); gpu3 lost its carrier (NO-CARRIER: none of its links is up)",
        ],
        "{:#?}",
        dp.events
    );
}

#[test]
fn a_gpus_interface_mtu_is_followed_said_and_undone() {
    let (mut dp, t) = plane(TWO);
    // gpu1's host lowers its MTU; a change to a GPU that does not exist is ignored.
    dp.ports.links = vec![(1, HostLink::Mtu(1000)), (7, HostLink::Mtu(100))];
    dp.step();
    assert_eq!(
        dp.model.gpu_mtu(closbox_fabric::topology::HostId(1)),
        Some(1000)
    );
    assert_eq!(dp.status().gpu_mtus, [("gpu1".to_string(), 1000)]);
    for (at, len) in [(5, 1000), (6, 1001), (7, 1400)] {
        dp.ports.inbox[0].push_back((StdDuration::from_micros(at), udp(&t, 0, 1, len)));
    }
    for _ in 0..1000 {
        dp.step();
    }
    let lens: Vec<usize> = dp.ports.sent.iter().map(|s| s.2.len()).collect();
    assert_eq!(lens, [1000]);
    let st = dp.status();
    let drops: std::collections::BTreeMap<String, u64> = st.drops.iter().cloned().collect();
    assert_eq!(drops["over_mtu"], 2);
    let into1 = st.ports.iter().find(|p| p.port == "sw0->gpu1").unwrap();
    assert_eq!(into1.drops_over_mtu, 2);
    assert_eq!(into1.drops(), 2);
    // The same MTU again says nothing; back to the fabric's, said and undone.
    dp.ports.links = vec![(1, HostLink::Mtu(1000))];
    dp.step();
    dp.ports.links = vec![(1, HostLink::Mtu(1500))];
    dp.step();
    let whats: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        whats,
        [
            "gpu1 interface mtu 1000 (was 1500; the fabric's 1500): its NIC drops frames longer than 1000 bytes (over_mtu)",
            "gpu1 interface mtu 1500 (was 1000): the fabric's again",
        ]
    );
    assert!(dp.status().gpu_mtus.is_empty());
    dp.ports.inbox[0].push_back((dp.ports.elapsed, udp(&t, 0, 1, 1400)));
    for _ in 0..1000 {
        dp.step();
    }
    assert_eq!(dp.ports.sent.len(), 2);
    // A raised MTU is listed too (its longer frames are dropped where they enter).
    dp.ports.links = vec![(0, HostLink::Mtu(9000))];
    dp.step();
    assert_eq!(dp.status().gpu_mtus, [("gpu0".to_string(), 9000)]);
    assert!(dp
        .events
        .last()
        .unwrap()
        .what
        .contains("its frames longer than 1500 bytes are dropped where they enter"));
}

#[test]
fn a_capture_on_an_idle_fabric_ends_when_its_duration_has_passed() {
    // With nothing due, the loop slept a second between its turns: a 5 ms capture of an
    // idle fabric at real time ended after a second.
    let (mut dp, _t) = plane(TWO);
    let (tx, _rx) = std::sync::mpsc::sync_channel(16);
    let ended = EndReason::default();
    dp.start_capture(CaptureSpec {
        ports: vec!["sw0->gpu0".into()],
        snaplen: 128,
        drops: false,
        count: None,
        duration_ns: Some(5_000_000),
        tx,
        ended: ended.clone(),
    })
    .unwrap();
    // When it ended: the clock at the first wait that began with it ended (a turn ends
    // it before its wait, which then sleeps the idle second).
    let at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (seen, mark) = (ended.clone(), at.clone());
    dp.ports.on_wait = Some(Box::new(move |now| {
        let mut at = mark.lock().unwrap();
        if at.is_none() && seen.get() != StreamEnd::Open {
            *at = Some(now);
        }
    }));
    for _ in 0..100 {
        if dp.captures.is_empty() {
            break;
        }
        dp.step();
    }
    assert!(dp.captures.is_empty(), "still capturing");
    assert_eq!(ended.get(), StreamEnd::Duration);
    let at = at.lock().unwrap().expect("a wait after the end");
    assert!(
        at >= StdDuration::from_millis(5) && at < StdDuration::from_millis(6),
        "ended at {at:?}"
    );
}

/// A scenario that waits for the GPUs' packets starts at the packet that completes its
/// trigger: its time 0 is that packet's, its changes at 0 are in place before that packet
/// enters (a partition at 0 drops it), a GPU outside the trigger does not start it, and a
/// cancel or a reset before its start drops it whole.
#[test]
fn a_timeline_armed_for_the_gpus_packets_starts_at_the_last_one_it_waits_for() {
    use crate::scenario::Start;
    let (mut dp, t) = plane(LS);
    let text = "start = \"every-gpu\"\n[[event]]\nat = \"0ms\"\ndo = \"partition\"\ngroups = [\"gpu0\", \"gpu1\"]\n[[event]]\nat = \"1ms\"\ndo = \"heal\"\n";
    let sc = crate::scenario::parse(text, "s.toml", &t).unwrap();
    assert_eq!(sc.start, Start::EveryGpu);
    let names =
        |v: &[usize]| -> Vec<String> { v.iter().map(|&i| t.hosts[i].name.clone()).collect() };
    let req = |start: Start, gpus: Vec<String>| Schedule {
        items: sc.items.clone(),
        faults: sc.faults.clone(),
        start: start.trigger(gpus),
    };
    let now = dp.fabric_now(dp.ports.now());
    let (id, events, start) = dp
        .schedule_request(req(Start::EveryGpu, names(&[0, 1])), now)
        .unwrap();
    assert_eq!(start, None);
    assert_eq!(
        events[0].what,
        format!("timeline {id} waits for a packet from each of its 2 GPUs to start (2 steps)")
    );
    // A GPU it does not watch, then one of the two: still waiting.
    dp.ports.inbox[2].push_back((StdDuration::from_micros(10), udp(&t, 2, 3, 100)));
    dp.ports.inbox[0].push_back((StdDuration::from_micros(20), udp(&t, 0, 3, 100)));
    step_to(&mut dp, StdDuration::from_micros(100));
    let st = dp.status();
    assert_eq!(
        st.timelines[0].waiting.as_deref(),
        Some("a packet from each of its 2 GPUs (1 still to send)")
    );
    assert_eq!(st.pending_changes, 2);
    assert!(st.partition.is_empty());
    // gpu1's packet, to gpu0, starts it, and is the partition's first drop. (An idle
    // plane's wait jumps the virtual clock a second ahead: times from where it is.)
    let t0 = dp.ports.elapsed;
    let us = StdDuration::from_micros;
    dp.ports.inbox[1].push_back((t0 + us(200), udp(&t, 1, 0, 100)));
    step_to(&mut dp, t0 + us(300));
    let started = dp
        .events
        .iter()
        .find(|e| starts(&e.what, id))
        .expect("started")
        .clone();
    assert_eq!(
        started.what,
        format!("timeline {id} started: each of its 2 GPUs has sent a packet, the last gpu1")
    );
    let want = (t0 + us(200)).as_nanos() as u64;
    assert!(
        (want..want + 1_000).contains(&started.fabric_ns),
        "{} vs {want}",
        started.fabric_ns
    );
    let drops: std::collections::BTreeMap<String, u64> = dp.status().drops.into_iter().collect();
    assert_eq!(drops.get("partitioned"), Some(&1), "{drops:?}");
    // Its heal, 1 ms of fabric time after its start.
    step_to(&mut dp, t0 + us(1_500));
    let heal = dp
        .events
        .iter()
        .find(|e| e.timeline == Some(id) && e.what.contains("heal"))
        .expect("healed");
    assert_eq!(heal.fabric_ns, started.fabric_ns + 1_000_000);
    assert!(dp.status().timelines.is_empty());

    // Cancelled before its start: dropped whole, and said so.
    let now = dp.fabric_now(dp.ports.now());
    let (id2, _, _) = dp
        .schedule_request(req(Start::FirstPacket, names(&[3])), now)
        .unwrap();
    assert_eq!(
        dp.status().timelines[0].waiting.as_deref(),
        Some("a packet from gpu3")
    );
    let (n, repaired) = dp.cancel(Some(id2));
    assert_eq!((n, repaired.len()), (2, 0));
    let last = &dp.events.last().unwrap().what;
    assert_eq!(
        last,
        &format!("timeline {id2} cancelled with 2 steps pending, before it started (it waited for a packet from gpu3)")
    );
    assert!(ends_early(last, id2));
    let t1 = dp.ports.elapsed;
    dp.ports.inbox[3].push_back((t1 + us(100), udp(&t, 3, 0, 100)));
    step_to(&mut dp, t1 + us(200));
    assert_eq!(dp.ports.inbox[3].len(), 0, "read");
    assert!(!dp.events.iter().any(|e| starts(&e.what, id2)));
    assert!(dp.status().partition.is_empty());

    // A reset cancels one waiting too; a GPU the fabric does not have is refused.
    let (id3, _, _) = dp
        .schedule_request(req(Start::FirstPacket, names(&[0, 1, 2, 3])), now)
        .unwrap();
    assert_eq!(
        dp.status().timelines[0].waiting.as_deref(),
        Some("the first packet from one of its 4 GPUs")
    );
    let reset = dp.change(&ChangeRequest::Reset).unwrap();
    assert!(
        reset[0]
            .what
            .ends_with("2 pending steps dropped (1 timeline cancelled)"),
        "{}",
        reset[0].what
    );
    assert!(dp.status().timelines.is_empty());
    let e = dp
        .schedule_request(req(Start::FirstPacket, vec!["gpu9".into()]), now)
        .unwrap_err();
    assert_eq!(
        e,
        "no GPU gpu9 on fabric t to start a timeline with its packets"
    );
    assert!(dp.timelines == id3, "a refused timeline takes no number");
    // At most MAX_ARMED wait at once (each is looked at for every packet).
    for _ in 0..changes::MAX_ARMED {
        dp.schedule_request(req(Start::FirstPacket, names(&[3])), now)
            .unwrap();
    }
    let e = dp
        .schedule_request(req(Start::FirstPacket, names(&[3])), now)
        .unwrap_err();
    assert!(e.starts_with("64 timelines already wait"), "{e}");
    assert_eq!(dp.cancel(None).0, 2 * changes::MAX_ARMED);
}

#[test]
fn a_capture_gets_a_packet_when_it_leaves_not_at_the_next_turn() {
    // The last packet of an exchange was handed to the captures after the loop's wait,
    // up to a second later: a capture ended meanwhile (Ctrl-C after a ping) lacked it.
    let (mut dp, t) = plane(TWO);
    let (tx, rx) = std::sync::mpsc::sync_channel(16);
    let start = dp
        .start_capture(CaptureSpec {
            ports: vec!["sw0->gpu1".into()],
            snaplen: 128,
            drops: false,
            count: None,
            duration_ns: None,
            tx,
            ended: EndReason::default(),
        })
        .unwrap();
    // What the capture had been handed as each wait began.
    let waits = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (seen, log) = (start.counters.clone(), waits.clone());
    dp.ports.on_wait = Some(Box::new(move |at| {
        let n = seen[0][0].load(std::sync::atomic::Ordering::Relaxed);
        log.lock().unwrap().push((at, n));
    }));
    dp.ports.inbox[0].push_back((StdDuration::ZERO, udp(&t, 0, 1, 100)));
    step_to(&mut dp, StdDuration::from_millis(10));
    let (port, delivered, _) = dp.ports.sent[0];
    assert_eq!(port, 1);
    let (i, tapped) = rx.try_recv().expect("the capture got nothing");
    assert_eq!((i, tapped.len), (0, 100));
    // The wait that followed the delivery began with the packet handed over.
    let waits = waits.lock().unwrap();
    let after = waits.iter().find(|w| w.0 >= delivered).unwrap();
    assert_eq!(after.1, 1, "delivered at {delivered:?}; waits {waits:?}");
}
