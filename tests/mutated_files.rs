//! The shipped topology and scenario files, mutated at random (seeded): lines dropped,
//! repeated, cut short or taken from another file, values replaced by hostile ones, digits
//! changed. Every mutant is either accepted (and then planned and modelled without a panic)
//! or refused with an error that says where (file:line:col), and predicted without a
//! hang. Needs no root.

mod common;

use std::panic::{self, AssertUnwindSafe};
use std::path::Path;

use closbox_fabric::rng::Rng;
use closbox_fabric::ConfigError;

/// Values put in place of a key's value: wrong types, zero, huge, negative, not numbers,
/// units at their limits, and words that name things of another kind.
const VALUES: &[&str] = &[
    "0",
    "-1",
    "1",
    "7",
    "65",
    "4294967296",
    "18446744073709551615",
    "1e308",
    "nan",
    "inf",
    "-0.5",
    "1.5",
    "true",
    "[]",
    "{}",
    "\"\"",
    "\"x\"",
    "\"0Gbit\"",
    "\"1bit\"",
    "\"100Tbit\"",
    "\"0us\"",
    "\"1ns\"",
    "\"1000000h\"",
    "\"0B\"",
    "\"1B\"",
    "\"9999999999GiB\"",
    "\"auto\"",
    "\"ecmp\"",
    "\"fq\"",
    "\"pfc\"",
    "\"credit\"",
    "{ k = \"0B\" }",
    "{ k = \"1GiB\" }",
    "\"leaf-spine\"",
    "\"single-switch\"",
    "\"custom\"",
    "\"spine0\"",
    "\"gpu0\"",
    "\"*\"",
    "\"link-flap\"",
    "\"switch-down\"",
    "\"partition\"",
    "\"load\"",
];

/// Words of the code, not of the files: types, serde's enum words, the raw structs.
const RUST_WORDS: &[&str] = &[
    "untagged", "i128", "i64", "u64", "u32", "f64", "Raw", "Spanned",
];

fn mutate(rng: &mut Rng, text: &str, others: &[String]) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    for _ in 0..1 + rng.below(3) {
        if lines.is_empty() {
            break;
        }
        let i = rng.below(lines.len() as u32) as usize;
        match rng.below(6) {
            0 => {
                lines.remove(i);
            }
            1 => {
                let at = rng.below(lines.len() as u32) as usize;
                lines.insert(at, lines[i].clone());
            }
            2 => {
                let other: Vec<&str> = others[rng.below(others.len() as u32) as usize]
                    .lines()
                    .collect();
                if !other.is_empty() {
                    lines.insert(i, other[rng.below(other.len() as u32) as usize].into());
                }
            }
            3 => {
                let digits: String = lines[i]
                    .chars()
                    .map(|c| match c.is_ascii_digit() && rng.below(3) == 0 {
                        true => char::from(b'0' + rng.below(10) as u8),
                        false => c,
                    })
                    .collect();
                lines[i] = digits;
            }
            4 => {
                let cut = rng.below(lines[i].len() as u32 + 1) as usize;
                if lines[i].is_char_boundary(cut) {
                    lines[i].truncate(cut);
                }
            }
            _ => {
                if let Some(eq) = lines[i].find('=') {
                    let v = VALUES[rng.below(VALUES.len() as u32) as usize];
                    lines[i] = format!("{}= {v}", &lines[i][..eq]);
                }
            }
        }
    }
    lines.join("\n")
}

fn files(dir: &str) -> Vec<String> {
    common::toml_files(dir)
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect()
}

/// Runs `check` on `n` mutants of `bases`; fails on any panic or unpositioned error.
fn mutants(seed: u64, n: usize, bases: &[String], check: impl Fn(&str) -> Result<(), ConfigError>) {
    let mut rng = Rng::new(seed, 0);
    let (mut accepted, mut refused) = (0, 0);
    for i in 0..n {
        let base = &bases[rng.below(bases.len() as u32) as usize];
        let text = mutate(&mut rng, base, bases);
        match panic::catch_unwind(AssertUnwindSafe(|| check(&text))) {
            Ok(Ok(())) => accepted += 1,
            Ok(Err(e)) => {
                assert!(
                    e.position.is_some() && e.to_string().starts_with("mutant.toml:"),
                    "mutant {i}: error without a position: {e}\n{text}"
                );
                // Said in the words of the files, not of the Rust code that reads them
                // ("data did not match any variant of untagged enum RawTimeScale").
                let said = e.to_string();
                if let Some(w) = RUST_WORDS.iter().find(|w| said.contains(*w)) {
                    panic!("mutant {i}: the error names Rust's {w:?}: {said}\n{text}");
                }
                refused += 1;
            }
            Err(_) => panic!("mutant {i} panicked (message above):\n{text}"),
        }
    }
    eprintln!("{n} mutants: {accepted} accepted, {refused} refused");
    // Both outcomes occur, or the mutations test little.
    assert!(
        accepted > n / 20 && refused > n / 20,
        "{accepted} accepted, {refused} refused"
    );
}

#[test]
fn mutated_topology_files_are_accepted_or_refused_with_a_position() {
    let bases = files("configs");
    assert!(bases.len() >= 5, "the shipped topology files");
    mutants(1, 4000, &bases, |text| {
        let topo = closbox_fabric::parse(text, "mutant.toml")?;
        if topo.hosts.len() <= 4096 {
            let _ = closbox_fabric::plan::Plan::of(&topo);
            let _ = closbox_fabric::Fabric::new(&topo);
        }
        Ok(())
    });
}

/// The predictions `bench` and `train` print, on accepted mutants (up to 64 GPUs): every
/// operation and algorithm, sizes from one element to 16 GiB, finite and not negative, and
/// made at all (a "1B" link rate — 8 bit/s — made the fluid simulation loop for ever).
#[test]
fn mutated_topology_files_are_predicted() {
    use closbox_agents::{Algo, Op};
    let bases = files("configs");
    mutants(2, 400, &bases, |text| {
        let topo = closbox_fabric::parse(text, "mutant.toml")?;
        let n = topo.hosts.len() as u32;
        if n == 0 || n > 64 {
            return Ok(());
        }
        for channels in [1, 3] {
            let p = closbox_predict::Predictor::new(&topo, (0..n).collect(), channels);
            for op in Op::ALL {
                for algo in [Algo::Auto, Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Hier] {
                    for size in [4, 1 << 20, 1 << 34] {
                        let t = p.predict(op, algo, size, (n - 1) as usize);
                        assert!(t.is_finite() && t >= 0.0, "{op:?} {algo:?} {size} B: {t}");
                    }
                }
            }
        }
        Ok(())
    });
}

#[test]
fn mutated_scenario_files_are_accepted_or_refused_with_a_position() {
    let topo =
        closbox_fabric::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.toml"))
            .unwrap();
    let bases = files("configs/chaos");
    assert!(bases.len() >= 3, "the shipped scenario files");
    mutants(2, 4000, &bases, |text| {
        closbox_switchd::scenario::parse(text, "mutant.toml", &topo).map(|_| ())
    });
}
