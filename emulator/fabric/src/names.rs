//! The names closbox turns into system objects: fabric names (directories, lock files,
//! namespace prefixes) and GPU names (hostnames, namespace suffixes, UTS pin files).
//!
//! One rule each, used wherever a name enters: topology files, the command line, state
//! files read back from disk. A name that passes can be joined onto a directory without
//! leaving it (no '/', no "." or "..", no leading '-' or '.').

/// Longest fabric name: namespaces are `cb-<fabric>.<gpu>` and stay readable.
pub const MAX_FABRIC_NAME: usize = 16;
/// Longest GPU or switch name (a hostname label is at most 63; this keeps paths short).
pub const MAX_HOST_NAME: usize = 32;

/// Checks a fabric name: 1 to 16 characters of `a-z`, `0-9` and `-`, starting with a letter.
pub fn check_fabric_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_FABRIC_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "fabric name {name:?} must be 1..={MAX_FABRIC_NAME} characters of a-z, 0-9 and '-', starting with a letter"
        ))
    }
}

/// Checks a GPU or switch name of a custom topology: 1 to 32 characters of `A-Z a-z 0-9 -
/// _ .`, starting with a letter or digit (so never "." or "..").
pub fn check_host_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_HOST_NAME
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "name {name:?} must be 1..={MAX_HOST_NAME} characters of A-Z, a-z, 0-9, '-', '_', '.', starting with a letter or digit"
        ))
    }
}

/// The network namespace of GPU `gpu` of fabric `fabric`. Fabric names hold no '.', so
/// the first '.' separates the two: fabric `a` with GPU `b-gpu0` and fabric `a-b` with
/// GPU `gpu0` get different namespaces.
pub fn netns_name(fabric: &str, gpu: &str) -> String {
    format!("cb-{fabric}.{gpu}")
}

/// A GPU selection as `run --gpus`, `partition` and scenario files take it: "all", ranks
/// and their ranges ("0-3,6"), names and their ranges ("gpu0,gpu4-gpu7"), separated by
/// commas. Returns indices into `names` (the fabric `fabric`'s GPUs), in the selection's
/// order; `unknown` words the error for a part that is none of these.
pub fn select_gpus(
    fabric: &str,
    names: &[&str],
    sel: &str,
    unknown: &dyn Fn(&str) -> String,
) -> Result<Vec<usize>, String> {
    let n = names.len();
    if sel == "all" {
        return Ok((0..n).collect());
    }
    let ranks = || format!("fabric {fabric} has ranks 0 to {}", n.saturating_sub(1));
    let index = |name: &str| names.iter().position(|g| *g == name);
    let mut out = Vec::new();
    // Ranks beyond any fabric's (more digits than fit) read as past its last GPU.
    let rank = |s: &str| -> Option<usize> {
        (!s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()))
            .then(|| s.parse().unwrap_or(usize::MAX))
    };
    for part in sel.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(format!(
                "GPU selection {sel:?} has an empty part (\"all\", or ranks and names \
                 separated by commas, as \"0-3,6\" or \"gpu0,gpu4-gpu7\")"
            ));
        }
        let rank_range = part
            .split_once('-')
            .and_then(|(a, b)| Some((rank(a)?, rank(b)?)));
        // "gpu2-gpu5" (names may hold dashes themselves: every dash is tried).
        let name_range = || {
            part.match_indices('-')
                .find_map(|(i, _)| Some((index(&part[..i])?, index(&part[i + 1..])?)))
        };
        // "gpu0-gpu9" on 4 GPUs: one end a GPU, the other not.
        let half_range = || {
            part.match_indices('-').find_map(|(i, _)| {
                let (a, b) = (&part[..i], &part[i + 1..]);
                match (index(a), index(b)) {
                    (Some(_), None) if !b.is_empty() => Some(b),
                    (None, Some(_)) if !a.is_empty() => Some(a),
                    _ => None,
                }
            })
        };
        if let Some((a, b)) = rank_range {
            if a > b {
                return Err(format!("GPU range {part:?} goes downward; write {b}-{a}"));
            }
            if b >= n {
                return Err(format!(
                    "GPU range {part:?} goes past the last GPU: {}",
                    ranks()
                ));
            }
            out.extend(a..=b);
        } else if let Some(r) = rank(part) {
            if r >= n {
                return Err(format!("no rank {part}: {}", ranks()));
            }
            out.push(r);
        } else if let Some(i) = index(part) {
            out.push(i);
        } else if let Some((a, b)) = name_range() {
            if a > b {
                return Err(format!(
                    "GPU range {part:?} goes downward; write {}-{}",
                    names[b], names[a]
                ));
            }
            out.extend(a..=b);
        } else if let Some(end) = half_range() {
            return Err(format!("GPU range {part:?}: {}", unknown(end)));
        } else {
            return Err(unknown(part));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(&dup) = out.iter().find(|&&i| !seen.insert(i)) {
        return Err(format!("GPU {} is selected twice", names[dup]));
    }
    if out.is_empty() {
        return Err("no GPU selected".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selections_take_ranks_names_and_ranges_of_both() {
        let names = ["gpu0", "gpu1", "gpu2", "gpu3", "node-1", "node-2"];
        let unknown = |p: &str| format!("no GPU {p:?}");
        let sel = |s: &str| select_gpus("f", &names, s, &unknown);
        assert_eq!(sel("all").unwrap(), [0, 1, 2, 3, 4, 5]);
        assert_eq!(sel("3,0-1").unwrap(), [3, 0, 1]);
        assert_eq!(sel("gpu1-gpu3, gpu0").unwrap(), [1, 2, 3, 0]);
        assert_eq!(sel("node-1-node-2").unwrap(), [4, 5]);
        assert_eq!(sel("node-2").unwrap(), [5]);
        for (s, e) in [
            ("3-1", "GPU range \"3-1\" goes downward; write 1-3"),
            (
                "gpu3-gpu1",
                "GPU range \"gpu3-gpu1\" goes downward; write gpu1-gpu3",
            ),
            (
                "0-6",
                "GPU range \"0-6\" goes past the last GPU: fabric f has ranks 0 to 5",
            ),
            ("9", "no rank 9: fabric f has ranks 0 to 5"),
            ("gpu0,0", "GPU gpu0 is selected twice"),
            ("gpu9", "no GPU \"gpu9\""),
            ("gpu0-x", "GPU range \"gpu0-x\": no GPU \"x\""),
            ("gpu0-gpu9", "GPU range \"gpu0-gpu9\": no GPU \"gpu9\""),
            ("node-1-node-9", "GPU range \"node-1-node-9\": no GPU \"node-9\""),
            ("gpu0-", "no GPU \"gpu0-\""),
            ("x", "no GPU \"x\""),
            (
                "0-99999999999999999999999",
                "GPU range \"0-99999999999999999999999\" goes past the last GPU: fabric f has ranks 0 to 5",
            ),
            (
                "99999999999999999999999",
                "no rank 99999999999999999999999: fabric f has ranks 0 to 5",
            ),
            (
                "",
                "GPU selection \"\" has an empty part (\"all\", or ranks and names separated by commas, as \"0-3,6\" or \"gpu0,gpu4-gpu7\")",
            ),
            (
                "0,,1",
                "GPU selection \"0,,1\" has an empty part (\"all\", or ranks and names separated by commas, as \"0-3,6\" or \"gpu0,gpu4-gpu7\")",
            ),
        ] {
            assert_eq!(sel(s).unwrap_err(), e, "{s:?}");
        }
    }

    #[test]
    fn fabric_names_cannot_leave_a_directory() {
        for bad in [
            "",
            "/",
            "..",
            ".",
            "/tmp/x",
            "a/b",
            "-a",
            "1a",
            "A",
            "a.b",
            "a_b",
            "a b",
            "abcdefghijklmnopq",
        ] {
            assert!(check_fabric_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "default", "ls-16", "abcdefghijklmnop"] {
            assert!(check_fabric_name(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn host_names_are_safe_path_components() {
        for bad in [".", "..", ".x", "-x", "_x", "a/b", "", "a b", "é"] {
            assert!(check_host_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["gpu0", "n0.g1", "Host_3", "0a"] {
            assert!(check_host_name(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn namespace_names_do_not_collide() {
        assert_ne!(netns_name("a", "b-gpu0"), netns_name("a-b", "gpu0"));
    }
}
