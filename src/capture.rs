//! `closbox capture`: packets as they leave fabric ports, into a pcapng file (or stdout)
//! that tcpdump, tshark and Wireshark read. Timestamps are fabric time (from the wall
//! clock at which the fabric came up), one interface per port.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context};
use closbox_switchd::chaos::port_ends;
use closbox_switchd::control::{self, Reply, Request};
use closbox_switchd::state::FabricName;

use crate::live;

/// Bytes of a stream's end kept: more than its last block or line.
const TAIL: usize = 64 * 1024;

/// Copies a daemon's stream (capture, recording) to `out` (named `dest` in errors) until
/// the daemon ends it, then flushes `out`; once `stop` is set (a signal), asks the daemon
/// to end it by shutting down our side.
///
/// Returns the stream's last bytes (up to `TAIL`), where the daemon says why it ended it.
pub fn copy_stream(
    stream: &mut std::io::BufReader<std::os::unix::net::UnixStream>,
    out: &mut dyn Write,
    dest: &str,
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Vec<u8>> {
    let daemon = "reading from the daemon";
    stream
        .get_ref()
        .set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .context(daemon)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut asked = false;
    let mut tail = Vec::with_capacity(2 * TAIL);
    loop {
        if stop.load(Ordering::Relaxed) && !asked {
            let _ = stream.get_ref().shutdown(std::net::Shutdown::Write);
            asked = true;
        }
        match stream.read(&mut buf) {
            Ok(0) => break,
            // Written out as it comes (a reader of the file or pipe sees packets when they
            // were taken, and an output that cannot be written fails at the header).
            Ok(n) => {
                out.write_all(&buf[..n])
                    .and_then(|()| out.flush())
                    .with_context(|| format!("writing {dest}"))?;
                if tail.len() + n > 2 * TAIL {
                    tail.drain(..(tail.len() + n).saturating_sub(TAIL).min(tail.len()));
                }
                tail.extend_from_slice(&buf[n.saturating_sub(TAIL)..n]);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e).context(daemon),
        }
    }
    out.flush().with_context(|| format!("writing {dest}"))?;
    Ok(tail)
}

/// " (fabric F went down)" when the daemon said it ended a stream because the fabric
/// went down (its count or duration reached are what was asked, and not said).
pub fn went_down(
    fabric: &closbox_switchd::state::FabricName,
    why: Option<closbox_switchd::dataplane::StreamEnd>,
) -> String {
    if why == Some(closbox_switchd::dataplane::StreamEnd::FabricDown) {
        format!(" (fabric {fabric} went down)")
    } else {
        String::new()
    }
}

/// Which ports to capture.
pub struct Selection<'a> {
    pub ports: &'a [String],
    pub links: &'a [String],
    pub gpus: &'a [String],
    pub all: bool,
}

pub struct Args<'a> {
    pub fabric: Option<&'a FabricName>,
    pub select: Selection<'a>,
    pub file: &'a Path,
    pub count: Option<u64>,
    pub duration_ns: Option<u64>,
    pub snaplen: u32,
    pub drops: bool,
}

/// The port names a selection means, checked against the fabric's ports. A port named
/// without its index ("leaf0->spine1" where parallel links join the two) means all of
/// them, as `--link` does.
fn resolve(all_ports: &[String], s: &Selection) -> anyhow::Result<Vec<String>> {
    if s.all {
        return Ok(all_ports.to_vec());
    }
    let mut out: Vec<String> = Vec::new();
    let mut add = |p: &String| {
        if !out.contains(p) {
            out.push(p.clone());
        }
    };
    let between = |from: &str, to: &str| {
        all_ports
            .iter()
            .filter(move |q| port_ends(q) == (from, to))
            .collect::<Vec<_>>()
    };
    for p in s.ports {
        let parallel = if p.contains(" #") {
            Vec::new()
        } else {
            let (from, to) = port_ends(p);
            between(from, to)
        };
        match all_ports.iter().find(|q| *q == p) {
            Some(q) => add(q),
            None if !parallel.is_empty() => parallel.into_iter().for_each(&mut add),
            None => {
                let from = port_ends(p).0;
                let near: Vec<&str> = all_ports
                    .iter()
                    .filter(|q| port_ends(q).0 == from)
                    .map(String::as_str)
                    .collect();
                return Err(crate::usage(format!(
                    "no port {p:?}; {}",
                    if near.is_empty() {
                        format!("ports are named like {:?}", all_ports[0])
                    } else {
                        format!("ports of {from}: {}", near.join(", "))
                    }
                )));
            }
        }
    }
    for pair in s.links.chunks(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let (ab, ba) = (between(a, b), between(b, a));
        if ab.is_empty() || ba.is_empty() {
            let linked_to = |x: &str| {
                let mut to: Vec<&str> = all_ports
                    .iter()
                    .filter(|q| port_ends(q).0 == x)
                    .map(|q| port_ends(q).1)
                    .collect();
                to.sort_unstable();
                to.dedup();
                to
            };
            if let Some(unknown) = [a, b].into_iter().find(|x| linked_to(x).is_empty()) {
                return Err(crate::usage(format!(
                    "no GPU or switch {unknown:?} in this fabric"
                )));
            }
            return Err(crate::usage(format!(
                "no link between {a} and {b}; {a} links to {}",
                linked_to(a).join(", ")
            )));
        }
        ab.into_iter().chain(ba).for_each(&mut add);
    }
    for g in s.gpus {
        let of: Vec<&String> = all_ports
            .iter()
            .filter(|p| {
                let (from, to) = port_ends(p);
                from == g || to == g
            })
            .collect();
        if of.is_empty() {
            return Err(crate::usage(format!("no GPU {g:?} in this fabric")));
        }
        of.into_iter().for_each(&mut add);
    }
    if out.is_empty() {
        return Err(crate::usage(
            "nothing to capture: give --port A->B, --link A B, --gpu G or --all",
        ));
    }
    Ok(out)
}

pub fn capture(a: Args) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox capture")?;
    let st = live::resolve(a.fabric)?;
    let all_ports: Vec<String> =
        match control::request(&st.fabric, &Request::Status { tcp: false })? {
            Reply::Status(s) => s.ports.iter().map(|p| p.port.clone()).collect(),
            Reply::Error { message } => bail!("{message}"),
            other => bail!("unexpected reply from the daemon: {other:?}"),
        };
    let ports = resolve(&all_ports, &a.select)?;
    let stop = closbox_switchd::stop_on_signals()?;
    let req = Request::Capture {
        ports: ports.clone(),
        snaplen: a.snaplen,
        drops: a.drops,
        count: a.count,
        duration_ns: a.duration_ns,
    };
    let (reply, mut stream) = control::open_stream(&st.fabric, &req)?;
    match reply {
        Reply::Capturing { .. } => {}
        Reply::Error { message } => return Err(crate::usage(message)),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
    // Created once the daemon took the request: a refused one leaves an existing file as
    // it was.
    let to_stdout = a.file == Path::new("-");
    let mut out: Box<dyn Write> = if to_stdout {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(
            std::fs::File::create(a.file)
                .with_context(|| format!("creating {}", a.file.display()))?,
        )
    };
    eprintln!(
        "closbox: capturing {} port{} of fabric {} ({}){}",
        ports.len(),
        if ports.len() == 1 { "" } else { "s" },
        st.fabric,
        if ports.len() <= 4 {
            ports.join(", ")
        } else {
            format!("{}, …", ports[..4].join(", "))
        },
        if a.count.is_none() && a.duration_ns.is_none() {
            "; Ctrl-C ends it"
        } else {
            ""
        }
    );
    // Copy the stream; a signal asks the daemon to end (it then writes the statistics).
    let dest = if to_stdout {
        "the capture to stdout".to_owned()
    } else {
        a.file.display().to_string()
    };
    let tail = copy_stream(&mut stream, &mut out, &dest, &stop)?;
    drop(out);
    // Summarized from the file written, if it is one (reading back a FIFO or a device
    // would wait for a writer or never end).
    let size =
        std::fs::metadata(a.file)
            .map_or(u64::MAX, |m| if m.is_file() { m.len() } else { u64::MAX });
    let summary = (!to_stdout && size <= 256 << 20)
        .then(|| std::fs::read(a.file).map(|b| closbox_switchd::pcapng::summarize(&b)))
        .transpose()?;
    let why = closbox_switchd::pcapng::ended(&tail)
        .and_then(closbox_switchd::dataplane::StreamEnd::from_words);
    let down = went_down(&st.fabric, why);
    if let Some((packets, dropped)) = summary {
        eprintln!(
            "closbox: {} packet{} written to {}{down}{}",
            packets,
            if packets == 1 { "" } else { "s" },
            a.file.display(),
            if dropped > 0 {
                format!(
                    "; {dropped} more not kept (the capture fell behind; counted in the file's statistics)"
                )
            } else {
                String::new()
            }
        );
    } else if !down.is_empty() {
        eprintln!("closbox: {dest} ended{down}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel<'a>(ports: &'a [String], links: &'a [String], gpus: &'a [String]) -> Selection<'a> {
        Selection {
            ports,
            links,
            gpus,
            all: false,
        }
    }

    #[test]
    fn a_port_named_without_its_index_means_every_parallel_one() {
        let all: Vec<String> = [
            "gpu0->leaf0",
            "leaf0->gpu0",
            "leaf0->spine0 #0",
            "spine0->leaf0 #0",
            "leaf0->spine0 #1",
            "spine0->leaf0 #1",
        ]
        .map(String::from)
        .to_vec();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let none: Vec<String> = Vec::new();
        let got = resolve(&all, &sel(&s(&["leaf0->spine0"]), &none, &none)).unwrap();
        assert_eq!(got, s(&["leaf0->spine0 #0", "leaf0->spine0 #1"]));
        let got = resolve(&all, &sel(&s(&["leaf0->spine0 #1"]), &none, &none)).unwrap();
        assert_eq!(got, s(&["leaf0->spine0 #1"]));
        let got = resolve(&all, &sel(&none, &s(&["spine0", "leaf0"]), &none)).unwrap();
        assert_eq!(
            got,
            s(&[
                "spine0->leaf0 #0",
                "spine0->leaf0 #1",
                "leaf0->spine0 #0",
                "leaf0->spine0 #1"
            ])
        );
        let got = resolve(&all, &sel(&none, &none, &s(&["gpu0"]))).unwrap();
        assert_eq!(got, s(&["gpu0->leaf0", "leaf0->gpu0"]));
        // Links named by their ends: an end that is no GPU or switch is named as such.
        let e = resolve(&all, &sel(&none, &s(&["x", "leaf0"]), &none)).unwrap_err();
        assert_eq!(e.to_string(), "no GPU or switch \"x\" in this fabric");
        let e = resolve(&all, &sel(&none, &s(&["gpu0", "spine0"]), &none)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no link between gpu0 and spine0; gpu0 links to leaf0"
        );
        let e = resolve(&all, &sel(&s(&["leaf0->spine0 #2"]), &none, &none)).unwrap_err();
        assert!(
            e.to_string()
                .contains("ports of leaf0: leaf0->gpu0, leaf0->spine0 #0, leaf0->spine0 #1"),
            "{e}"
        );
    }
}
