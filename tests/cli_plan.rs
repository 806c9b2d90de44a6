//! The `closbox` binary on topology files: every shipped config loads and plans; broken
//! ones fail with file:line and never panic. Needs no root.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn closbox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args(args)
        .output()
        .expect("run closbox")
}

fn configs() -> Vec<PathBuf> {
    common::toml_files("configs")
}

#[test]
fn every_shipped_config_plans() {
    let files = configs();
    for required in [
        "single-switch-8",
        "full-mesh-8",
        "leaf-spine-16",
        "leaf-spine-3to1",
        "fat-tree-k4",
        "rail-optimized-32",
        "superpod-su",
    ] {
        assert!(
            files.iter().any(|f| f.file_stem().unwrap() == required),
            "configs/{required}.toml missing"
        );
    }
    for f in files {
        let out = closbox(&["plan", f.to_str().unwrap()]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("bisection bandwidth"), "{stdout}");
        let json = closbox(&["plan", f.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("valid JSON");
        assert!(v["gpus"].as_u64().unwrap() >= 8);
    }
}

#[test]
fn superpod_su_is_256_gpus_at_one_to_one() {
    let out = closbox(&["plan", "configs/superpod-su.toml", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"], 256);
    assert_eq!(v["nodes"], 32);
    let leaf = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "leaf")
        .unwrap();
    assert_eq!(leaf["switches"], 8);
    assert_eq!(leaf["ports_max"], 64);
    assert_eq!(leaf["oversubscription"], 1.0);
}

#[test]
fn sizing_200k_gpus_prints_exact_figures() {
    let out = closbox(&[
        "plan",
        "--gpus",
        "200000",
        "--topology",
        "leaf-spine",
        "--radix",
        "64",
    ]);
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("199,999 ports per GPU"), "{s}");
    assert!(s.contains("19,999,900,000 cables"), "{s}");
    assert!(s.contains("reaches at most 2,048 GPUs"), "{s}");
    assert!(s.contains("reaches at most 65,536 GPUs"), "{s}");
}

#[test]
fn broken_configs_name_file_and_line() {
    let dir = common::test_dir("plan");
    let cases = [
        ("[fabric]\nname = \"x\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\nrate = \"fast\"\n", ":9:8: invalid rate"),
        ("[fabric]\nname = \"x\"\n[topology]\nkind = \"single-switch\"\ngpus = 4\nbogus = 3\n", ":6:1: unknown field `bogus`"),
        ("[fabric]\nname = \"x\"\n[topology]\nkind = \"single-switch\"\ngpus = 70\n[switches.leaf]\nradix = 64\n", ":7:9: switch \"sw0\" needs 70 ports"),
        ("not toml at all [", ":1:"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let f = dir.join(format!("bad{i}.toml"));
        std::fs::write(&f, text).unwrap();
        let out = closbox(&["plan", f.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("bad{i}.toml{want}")),
            "case {i}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
