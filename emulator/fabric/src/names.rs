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

#[cfg(test)]
mod tests {
    use super::*;

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
