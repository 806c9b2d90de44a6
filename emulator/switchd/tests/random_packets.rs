//! What a GPU may hand the data plane, at random (seeded): IPv4 super-packets with random
//! virtio headers, IP and TCP header lengths (options included), lengths, protocols, ECN
//! codepoints and addresses, cut by `offload::segment`, carried by the model on three
//! fabrics (one fast switch; lossy links with ECN, shallow buffers and `fq` NICs; PFC),
//! and written back as the data plane writes them (runs coalesced, singles with their
//! virtio header), taps and capture blocks included. Nothing panics, the model accounts
//! for every frame, and every coalesced run carries exactly its frames' bytes. (A frame
//! with IP options followed by one without once panicked the data plane here.)

use std::sync::Arc;

use closbox_fabric::rng::Rng;
use closbox_fabric::routing::PortId;
use closbox_fabric::{Frame, HostId, Instant};
use closbox_switchd::offload::{
    coalesced_headers, fill_checksum, mergeable_run, payloads, segment, single_hdr, VnetHdr,
    F_NEEDS_CSUM, GSO_ECN, GSO_NONE, GSO_TCPV4, VNET_HDR_LEN,
};

const FABRICS: &[&str] = &[
    "mtu = 9000\n[topology]\nkind = \"single-switch\"\ngpus = 2\n[links.nic]\nrate = \"100Gbit\"\n",
    "mtu = 1500\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 2\n\
     [links.nic]\nrate = \"10Gbit\"\nloss = 0.01\n[links.leaf-spine]\nrate = \"1Gbit\"\n\
     [switches.leaf]\nbuffer = \"64KiB\"\necn = { k = \"16KiB\" }\n[nic]\nscheduler = \"fq\"\n",
    "mtu = 4000\nflow_control = \"pfc\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\n\
     gpus_per_leaf = 2\n[links.nic]\nrate = \"10Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n",
];

/// One random IPv4 packet from GPU `src` of `hosts` (addresses from 198.18.0.0), mostly
/// well formed, sometimes not; and the virtio header it comes with.
fn packet(rng: &mut Rng, src: u8, hosts: u32) -> (VnetHdr, Vec<u8>) {
    let mut words = |usual: u32| match rng.below(8) {
        0 => rng.below(16) as usize,
        1 | 2 => usual as usize + rng.below(11) as usize,
        _ => usual as usize,
    };
    let (ihl, thl) = (words(5), words(5));
    let payload = match rng.below(4) {
        0 => 0,
        1 => rng.below(100),
        2 => rng.below(9000),
        _ => rng.below(65_400),
    } as usize;
    let total = ihl * 4 + thl * 4 + payload;
    let mut p: Vec<u8> = (0..total.max(20)).map(|_| rng.below(256) as u8).collect();
    p[0] = match rng.below(10) {
        0 => rng.below(256) as u8,
        _ => 0x40 | ihl as u8,
    };
    p[1] = rng.below(4) as u8;
    let len = match rng.below(10) {
        0 => rng.below(65_536) as u16,
        _ => total.min(65_535) as u16,
    };
    p[2..4].copy_from_slice(&len.to_be_bytes());
    if rng.below(4) != 0 {
        p[6..8].copy_from_slice(&[0x40, 0]);
    }
    p[9] = match rng.below(10) {
        0 => rng.below(256) as u8,
        1 => 17,
        _ => 6,
    };
    p[12..16].copy_from_slice(&[198, 18, 0, src]);
    let dst = match rng.below(10) {
        0 => rng.below(256),
        _ => rng.below(hosts),
    };
    p[16..20].copy_from_slice(&[198, 18, 0, dst as u8]);
    if ihl * 4 + 13 < p.len() {
        p[ihl * 4 + 12] = (thl as u8) << 4;
    }
    let h = (p[0] & 0x0f) as usize * 4;
    if rng.below(2) == 0 && h >= 20 && h <= p.len() {
        closbox_fabric::packet::set_header_checksum(&mut p);
    }
    let hdr = VnetHdr {
        flags: [F_NEEDS_CSUM, rng.below(256) as u8][rng.below(2) as usize],
        gso_type: match rng.below(5) {
            0 => GSO_NONE,
            1 => rng.below(256) as u8,
            2 => GSO_TCPV4 | GSO_ECN,
            _ => GSO_TCPV4,
        },
        hdr_len: rng.below(65_536) as u16,
        gso_size: [0, 1, rng.below(65_536), 1448, 8948, 8948][rng.below(6) as usize] as u16,
        csum_start: (ihl * 4) as u16,
        csum_offset: 16,
    };
    (hdr, p)
}

#[test]
fn random_super_packets_are_cut_carried_and_written_back_whole() {
    for (i, body) in FABRICS.iter().enumerate() {
        let topo = closbox_fabric::parse(&format!("[fabric]\nname = \"rp\"\n{body}"), "rp.toml")
            .unwrap_or_else(|e| panic!("{e}"));
        let hosts = topo.hosts.len() as u32;
        let mut model = closbox_fabric::Fabric::new(&topo);
        let ports = model.port_counters(Instant::from_nanos(0)).len() as u32;
        model.set_taps(&(0..ports).map(PortId).collect::<Vec<_>>(), 200, true);
        model.enable_flows(1000);
        let mut rng = Rng::new(11, i as u64);
        let (mut heads, mut cut, mut got) = (Vec::new(), Vec::new(), Vec::new());
        let (mut t, mut written, mut capture) = (0u64, 0u64, Vec::new());
        for _ in 0..2000 {
            let src = rng.below(hosts);
            let (hdr, p) = packet(&mut rng, src as u8, hosts);
            let mut buf = vec![0u8; VNET_HDR_LEN];
            buf.extend_from_slice(&p);
            let buf = Arc::new(buf);
            cut.clear();
            if segment(&hdr, &buf, VNET_HDR_LEN..buf.len(), &mut cut, &mut heads).is_err() {
                // Handed on whole, as the data plane does; the model judges it.
                cut.push(Frame::from(p));
            }
            t += 1000;
            for f in cut.drain(..) {
                let _ = model.send(Instant::from_nanos(t), HostId(src), f);
            }
            t += rng.below(200_000) as u64;
            model.advance(Instant::from_nanos(t));
            while let Some(tap) = model.poll_tapped() {
                let mut copy = tap.data;
                fill_checksum(&mut copy);
                capture.clear();
                let why = tap.dropped.map(|d| d.name());
                closbox_switchd::pcapng::packet(
                    0,
                    tap.at.as_nanos(),
                    &copy,
                    tap.len,
                    why,
                    &mut capture,
                );
            }
            got.clear();
            while let Some(d) = model.poll_delivery() {
                got.push(d.data);
            }
            let mut at = 0;
            while at < got.len() {
                let n = mergeable_run(&got[at..]);
                let run = &got[at..at + n];
                if n > 1 {
                    let (v, h) = coalesced_headers(run);
                    let mut io = Vec::new();
                    payloads(run, h.len(), &mut io);
                    let bytes: usize = io.iter().map(|s| s.len()).sum();
                    let want: usize = run.iter().map(|f| f.len() - h.len()).sum();
                    assert_eq!(bytes, want, "a run's payloads");
                    assert_eq!(u16::from_be_bytes([h[2], h[3]]) as usize, h.len() + want);
                    assert_eq!(v.gso_type & !GSO_ECN, GSO_TCPV4);
                } else {
                    let _ = single_hdr(run[0].head());
                }
                written += n as u64;
                at += n;
            }
        }
        // Every frame handed over was delivered (to a GPU, written, or to a switch it was
        // addressed to), dropped (and counted), or is still held.
        let tot = model.totals(Instant::from_nanos(t));
        assert_eq!(written + tot.to_switches, tot.delivered, "fabric {i}");
        assert_eq!(
            tot.sent,
            tot.delivered + tot.drops.total() + tot.queued + tot.in_flight,
            "fabric {i}: {tot:?}"
        );
        assert!(
            tot.delivered > 1000 && tot.drops.total() > 100,
            "fabric {i}: {tot:?}"
        );
        let _ = model.flows();
    }
}
