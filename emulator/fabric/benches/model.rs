//! Packet-hop events per second through a leaf-spine model on one core.
//!
//! A packet-hop is one packet crossing one egress port (queue, serialization, propagation,
//! next switch). 64 GPUs under 8 leaves and 8 spines send 1500-byte packets to random
//! peers at ~60% load; the bench reports hops/s (criterion's "elem/s"), lossy and with
//! PFC (a lossless fabric schedules each port's departures one by one: one more event per
//! packet-hop).

use std::hint::black_box;

use closbox_fabric::model::Fabric;
use closbox_fabric::packet::build_udp;
use closbox_fabric::rng::Rng;
use closbox_fabric::{parse, HostId, Instant, Topology};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const TOPO: &str = r#"
[fabric]
name = "bench"
seed = 3
[topology]
kind = "leaf-spine"
leaves = 8
spines = 8
gpus_per_leaf = 8
[links.nic]
rate = "100Gbit"
delay = "500ns"
[links.leaf-spine]
rate = "100Gbit"
delay = "1us"
[switches.leaf]
ecn = { k = "100KiB" }
[switches.spine]
ecn = { k = "100KiB" }
"#;

struct Workload {
    topo: Topology,
    /// (send time ns, src, IPv4 + UDP header of a 1500-byte packet)
    sends: Vec<(u64, u32, [u8; 28])>,
    hops: u64,
}

/// `flow_control`: a line for `[fabric]` ("" for the lossy default).
fn workload(packets: usize, flow_control: &str) -> Workload {
    let text = TOPO.replace("seed = 3\n", &format!("seed = 3\n{flow_control}\n"));
    let topo = parse(&text, "bench").expect("bench topology");
    let routes = Fabric::new(&topo);
    let n = topo.hosts.len() as u32;
    let mut rng = Rng::new(42, 0);
    // 64 GPUs × 100 Gbit/s; 1538 wire bytes = 123 ns each: a packet every 3.2 ns is ~60%.
    let mut t = 0u64;
    let mut hops = 0;
    let sends = (0..packets)
        .map(|_| {
            t += 1 + rng.below(5) as u64;
            let src = rng.below(n);
            let dst = (src + 1 + rng.below(n - 1)) % n;
            hops += routes
                .routes()
                .hops(HostId(src), HostId(dst))
                .expect("reachable") as u64;
            let (a, b) = (topo.hosts[src as usize].addr, topo.hosts[dst as usize].addr);
            let packet = build_udp(a, b, rng.below(64) as u16, 4791, 0b10, 1500);
            (t, src, packet[..28].try_into().expect("28 header bytes"))
        })
        .collect();
    Workload { topo, sends, hops }
}

fn run(w: &Workload, pool: &mut Vec<Vec<u8>>) -> usize {
    let mut f = Fabric::new(&w.topo);
    let mut delivered = 0;
    for (t, src, header) in &w.sends {
        let (t, src) = (*t, *src);
        let mut buf = pool.pop().unwrap_or_else(|| vec![0; 1500]);
        buf[..28].copy_from_slice(header);
        let _ = f.send(Instant::from_nanos(t), HostId(src), buf);
        while let Some(d) = f.poll_delivery() {
            delivered += 1;
            pool.push(d.data.into_vec());
        }
    }
    while let Some(t) = f.poll_timeout() {
        f.advance(t);
        while let Some(d) = f.poll_delivery() {
            delivered += 1;
            pool.push(d.data.into_vec());
        }
    }
    delivered
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("model");
    g.sample_size(10);
    for (name, fc) in [
        ("leaf-spine-64 packet-hops", ""),
        ("leaf-spine-64 packet-hops pfc", "flow_control = \"pfc\""),
    ] {
        let w = workload(200_000, fc);
        let mut pool = Vec::new();
        let delivered = run(&w, &mut pool);
        assert!(
            delivered > 190_000,
            "the workload must not be mostly drops: {delivered}"
        );
        g.throughput(Throughput::Elements(w.hops));
        g.bench_function(name, |b| b.iter(|| black_box(run(&w, &mut pool))));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
