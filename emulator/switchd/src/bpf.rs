//! DCTCP for the GPUs on a kernel without it: `[nic] tcp_congestion = "dctcp"`.
//!
//! The fabric's switches mark ECN as DCTCP expects (`ecn = { k = SIZE }`, a step), but a
//! host's TCP answers marks with its own congestion control, and this box's kernel (as
//! many distribution kernels) is built without `tcp_dctcp`. Since Linux 5.6 a congestion
//! control can be a BPF program (`struct_ops`); `bpf/dctcp.bpf.c` is DCTCP written that
//! way, compiled into the daemon by `build.rs`. The daemon registers it as
//! `closbox_dctcp` through a BPF link (Linux 6.4) it holds for its whole life: however the
//! daemon ends, even by SIGKILL, the kernel closes the link and unregisters it, so nothing
//! outlives the fabric (connections still using it keep it until they close).
//!
//! Loading goes through libbpf (it resolves the program's kernel fields against the
//! running kernel's BTF, the kfunc it calls, and the `struct_ops` map's layout), opened
//! with `dlopen` so that closbox needs `libbpf.so.1` (Debian `libbpf1`, which `iproute2`
//! already depends on) only on a fabric that asks for DCTCP.

use std::fs;
use std::os::fd::OwnedFd;

#[cfg(not(closbox_bpf))]
use anyhow::bail;

/// The name closbox's DCTCP is registered under (`net.ipv4.tcp_congestion_control`).
pub const NAME: &str = "closbox_dctcp";

/// What a fabric's GPUs run for `tcp_congestion = "dctcp"`, held by the daemon.
#[derive(Debug)]
pub struct Dctcp {
    name: &'static str,
    /// The BPF link that keeps closbox's DCTCP registered, when this daemon registered
    /// it (another fabric's daemon may have: it is then used as it is).
    _link: Option<OwnedFd>,
}

impl Dctcp {
    /// The congestion control's name, for each GPU's `tcp_congestion_control`.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

fn listed(file: &str, name: &str) -> bool {
    fs::read_to_string(format!("/proc/sys/net/ipv4/{file}"))
        .is_ok_and(|s| s.split_whitespace().any(|n| n == name))
}

/// DCTCP for this daemon's GPUs: the kernel's own when it lets network namespaces use it
/// (`tcp_allowed_congestion_control` lists `dctcp`), otherwise closbox's, registered here
/// for as long as the returned value lives, or as another fabric registered it, then held
/// by both.
pub fn dctcp() -> anyhow::Result<Dctcp> {
    if listed("tcp_allowed_congestion_control", "dctcp") {
        return Ok(Dctcp {
            name: "dctcp",
            _link: None,
        });
    }
    // Registered by another fabric's daemon: held here too, so that it stays registered
    // while this fabric lives, whichever goes down first (between the check and the
    // GPUs' sysctls the other's `down` would otherwise unregister it, and this `up` fail).
    if let Some(d) = registered() {
        return Ok(d);
    }
    match register() {
        Ok(link) => Ok(Dctcp {
            name: NAME,
            _link: Some(link),
        }),
        // Another fabric's daemon registered it meanwhile.
        Err(e) => registered().ok_or(e).map_err(|e| e.context(format!(
            "tcp_congestion = \"dctcp\": this kernel has no dctcp of its own for network namespaces (net.ipv4.tcp_allowed_congestion_control), and closbox's ({NAME}, a BPF program) could not be registered"
        ))),
    }
}

/// closbox's DCTCP as another daemon registered it: its BPF link, held (the kernel keeps a
/// registration while any descriptor of its link is open), or, registered some other way
/// (without a link), used as it is.
fn registered() -> Option<Dctcp> {
    if !listed("tcp_available_congestion_control", NAME) {
        return None;
    }
    let link = match link::find(MAP_NAME) {
        Ok(link) => link,
        Err(e) => {
            tracing::debug!("looking for {NAME}'s BPF link: {e}");
            None
        }
    };
    // The link held, the name must still be there (its holder may have closed the last
    // other descriptor just before); without a link, it is what it is.
    listed("tcp_available_congestion_control", NAME).then_some(Dctcp {
        name: NAME,
        _link: link,
    })
}

/// The name of the `struct_ops` map of `bpf/dctcp.bpf.c` (its variable's name).
const MAP_NAME: &str = "cb_dctcp";

/// BPF links found by what they register, through the `bpf(2)` system call.
mod link {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
    const BPF_LINK_GET_NEXT_ID: libc::c_long = 31;
    const BPF_LINK_TYPE_STRUCT_OPS: u32 = 9;
    const BPF_MAP_TYPE_STRUCT_OPS: u32 = 26;

    /// `bpf(cmd, attr)` with a zero-padded `union bpf_attr` prefix.
    fn bpf(cmd: libc::c_long, attr: &mut [u32; 16]) -> std::io::Result<libc::c_long> {
        // SAFETY: attr is a union bpf_attr prefix of the size passed; the kernel reads
        // and writes within it (and through pointers it holds, which callers set to live
        // buffers of the lengths they give).
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr.as_mut_ptr(),
                std::mem::size_of_val(attr),
            )
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// A descriptor of the link or map (`cmd`) of id `id`; `None` if it is gone.
    fn fd_by_id(cmd: libc::c_long, id: u32) -> std::io::Result<Option<OwnedFd>> {
        let mut attr = [0u32; 16];
        attr[0] = id;
        match bpf(cmd, &mut attr) {
            // SAFETY: a new descriptor, owned by nobody else.
            Ok(fd) => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `BPF_OBJ_GET_INFO_BY_FD` into `info` (a `bpf_link_info` or `bpf_map_info`).
    fn info(fd: &OwnedFd, info: &mut [u64]) -> std::io::Result<()> {
        let mut attr = [0u32; 16];
        attr[0] = fd.as_raw_fd() as u32;
        attr[1] = std::mem::size_of_val(info) as u32;
        let p = info.as_mut_ptr() as u64;
        attr[2] = p as u32;
        attr[3] = (p >> 32) as u32;
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
    }

    /// A descriptor of the live `struct_ops` link whose map is named `map_name`, if any.
    pub(super) fn find(map_name: &str) -> std::io::Result<Option<OwnedFd>> {
        let mut id = 0u32;
        loop {
            let mut attr = [0u32; 16];
            attr[0] = id;
            match bpf(BPF_LINK_GET_NEXT_ID, &mut attr) {
                Ok(_) => id = attr[1],
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
                Err(e) => return Err(e),
            }
            // Gone since it was listed: the next one.
            let Some(link) = fd_by_id(BPF_LINK_GET_FD_BY_ID, id)? else {
                continue;
            };
            // struct bpf_link_info: type, id, prog_id (u32 each), then a union aligned to
            // 8 bytes whose struct_ops member starts with its map's id.
            let mut li = [0u64; 8];
            info(&link, &mut li)?;
            if li[0] as u32 != BPF_LINK_TYPE_STRUCT_OPS {
                continue;
            }
            let map_id = li[2] as u32;
            // A link detached from its map reads map id 0.
            if map_id == 0 {
                continue;
            }
            let Some(map) = fd_by_id(BPF_MAP_GET_FD_BY_ID, map_id)? else {
                continue;
            };
            // struct bpf_map_info: type, id, key_size, value_size, max_entries,
            // map_flags (u32 each), then name[16].
            let mut mi = [0u64; 10];
            info(&map, &mut mi)?;
            if mi[0] as u32 != BPF_MAP_TYPE_STRUCT_OPS {
                continue;
            }
            let bytes: Vec<u8> = mi[3..5].iter().flat_map(|w| w.to_ne_bytes()).collect();
            let name = bytes.split(|&b| b == 0).next().unwrap_or_default();
            if name == map_name.as_bytes() {
                return Ok(Some(link));
            }
        }
    }
}

#[cfg(not(closbox_bpf))]
fn register() -> anyhow::Result<OwnedFd> {
    bail!("this closbox was built without it (no clang at build time: install clang and rebuild with `make build`)")
}

#[cfg(closbox_bpf)]
use load::register;

/// Loading and registering the embedded object (built only where clang compiled it).
#[cfg(closbox_bpf)]
mod load {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::sync::Mutex;

    use anyhow::{anyhow, bail, Context};

    use super::{listed, NAME};

    static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/dctcp.bpf.o"));

    /// libbpf's messages while loading (its verifier log among them), for the error.
    static LOG: Mutex<String> = Mutex::new(String::new());

    extern "C" {
        fn vsnprintf(buf: *mut c_char, n: usize, fmt: *const c_char, ap: *mut c_void) -> c_int;
    }

    /// libbpf's print callback: keeps warnings and information, drops debug output.
    extern "C" fn keep_log(level: c_int, fmt: *const c_char, ap: *mut c_void) -> c_int {
        const DEBUG: c_int = 2;
        if level >= DEBUG {
            return 0;
        }
        // A failed load's verifier log comes as one message, and its end says why.
        let mut buf = vec![0 as c_char; 64 << 10];
        // SAFETY: libbpf passes a format and its va_list (a pointer to it, as C passes a
        // va_list argument); vsnprintf writes at most buf.len() bytes, NUL included.
        let n = unsafe { vsnprintf(buf.as_mut_ptr(), buf.len(), fmt, ap) };
        if n > 0 {
            // SAFETY: vsnprintf NUL-terminated what it wrote within buf.
            let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
            if let Ok(mut log) = LOG.lock() {
                if log.len() < 64 << 10 {
                    log.push_str(&s.to_string_lossy());
                }
            }
        }
        n
    }

    /// The last lines libbpf logged, for an error message.
    fn log_tail() -> String {
        let log = LOG.lock().map(|l| l.clone()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = &lines[lines.len().saturating_sub(12)..];
        if tail.is_empty() {
            String::new()
        } else {
            format!("; libbpf said:\n  {}", tail.join("\n  "))
        }
    }

    /// The functions of libbpf 1.x this uses (a stable ABI: libbpf.so.1).
    struct Libbpf {
        handle: *mut c_void,
        set_print: unsafe extern "C" fn(Option<LogFn>) -> Option<LogFn>,
        open_mem: unsafe extern "C" fn(*const c_void, usize, *const c_void) -> *mut c_void,
        find_map: unsafe extern "C" fn(*const c_void, *const c_char) -> *mut c_void,
        set_map_flags: unsafe extern "C" fn(*mut c_void, u32) -> c_int,
        load: unsafe extern "C" fn(*mut c_void) -> c_int,
        close: unsafe extern "C" fn(*mut c_void),
        map_fd: unsafe extern "C" fn(*const c_void) -> c_int,
        attach_struct_ops: unsafe extern "C" fn(*const c_void) -> *mut c_void,
        link_fd: unsafe extern "C" fn(*const c_void) -> c_int,
        link_disconnect: unsafe extern "C" fn(*mut c_void),
        link_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    }

    type LogFn = extern "C" fn(c_int, *const c_char, *mut c_void) -> c_int;

    impl Libbpf {
        fn open() -> anyhow::Result<Libbpf> {
            // SAFETY: a constant C string; the handle is closed in Drop.
            let handle = unsafe { libc::dlopen(c"libbpf.so.1".as_ptr(), libc::RTLD_NOW) };
            if handle.is_null() {
                bail!("libbpf.so.1 is not installed (Debian: apt-get install libbpf1)");
            }
            /// A function of the library, as the pointer type `F` its C signature gives.
            ///
            /// # Safety
            /// `F` must be a function pointer type matching the symbol's C signature.
            unsafe fn sym<F: Copy>(handle: *mut c_void, name: &CStr) -> anyhow::Result<F> {
                assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
                // SAFETY: handle is a live dlopen handle; name is a C string.
                let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
                if p.is_null() {
                    bail!("libbpf.so.1 has no {name:?}: too old (libbpf 1.0 or later needed)");
                }
                // SAFETY: the caller names F as the symbol's type; both are one pointer.
                Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
            }
            // SAFETY (each sym): the field's type states the C signature of libbpf 1.x's
            // function of that name.
            let lib = (|| unsafe {
                Ok(Libbpf {
                    handle,
                    set_print: sym(handle, c"libbpf_set_print")?,
                    open_mem: sym(handle, c"bpf_object__open_mem")?,
                    find_map: sym(handle, c"bpf_object__find_map_by_name")?,
                    set_map_flags: sym(handle, c"bpf_map__set_map_flags")?,
                    load: sym(handle, c"bpf_object__load")?,
                    close: sym(handle, c"bpf_object__close")?,
                    map_fd: sym(handle, c"bpf_map__fd")?,
                    attach_struct_ops: sym(handle, c"bpf_map__attach_struct_ops")?,
                    link_fd: sym(handle, c"bpf_link__fd")?,
                    link_disconnect: sym(handle, c"bpf_link__disconnect")?,
                    link_destroy: sym(handle, c"bpf_link__destroy")?,
                })
            })();
            if lib.is_err() {
                // SAFETY: the handle came from dlopen and nothing of it is kept.
                unsafe { libc::dlclose(handle) };
            }
            lib
        }
    }

    impl Drop for Libbpf {
        fn drop(&mut self) {
            // SAFETY: the handle came from dlopen; nothing of the library is used after this
            // (the print callback is unset before, in `register`).
            unsafe { libc::dlclose(self.handle) };
        }
    }

    /// A struct_ops map's registration lives as long as a BPF link (Linux 6.4).
    const BPF_F_LINK: u32 = 1 << 13;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_STRUCT_OPS: u32 = 44;

    /// `bpf(BPF_LINK_CREATE)` of a struct_ops map: registers it until the link is closed.
    fn link_struct_ops(map_fd: c_int) -> std::io::Result<OwnedFd> {
        // union bpf_attr's link_create: map_fd (u32, shared with prog_fd), target_fd (u32),
        // attach_type (u32), flags (u32); the rest zero.
        let mut attr = [0u32; 16];
        attr[0] = map_fd as u32;
        attr[2] = BPF_STRUCT_OPS;
        // SAFETY: attr is a zeroed union bpf_attr prefix of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_LINK_CREATE,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as c_int) })
    }

    pub(super) fn register() -> anyhow::Result<OwnedFd> {
        let lib = Libbpf::open()?;
        if let Ok(mut log) = LOG.lock() {
            log.clear();
        }
        // The object in a buffer aligned for its ELF structures.
        let mut buf = vec![0u64; OBJECT.len().div_ceil(8)];
        // SAFETY: buf holds at least OBJECT.len() bytes; u64 has no invalid byte patterns.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), OBJECT.len()) };
        bytes.copy_from_slice(OBJECT);
        // SAFETY: keep_log has the signature libbpf_print_fn_t.
        let old_print = unsafe { (lib.set_print)(Some(keep_log)) };
        let result = (|| -> anyhow::Result<OwnedFd> {
            // SAFETY: a valid buffer of that length, outliving the object (closed below).
            let obj =
                unsafe { (lib.open_mem)(buf.as_ptr().cast(), OBJECT.len(), std::ptr::null()) };
            if obj.is_null() {
                return Err(std::io::Error::last_os_error()).context("opening the BPF object");
            }
            let r = (|| -> anyhow::Result<OwnedFd> {
                // SAFETY: obj is an open object; the name is a C string.
                let map = unsafe { (lib.find_map)(obj, c"cb_dctcp".as_ptr()) };
                if map.is_null() {
                    bail!("the BPF object has no map cb_dctcp");
                }
                // SAFETY: map belongs to obj, not loaded yet.
                let e = unsafe { (lib.set_map_flags)(map, BPF_F_LINK) };
                if e < 0 {
                    bail!(
                        "bpf_map__set_map_flags: {}",
                        std::io::Error::from_raw_os_error(-e)
                    );
                }
                // SAFETY: obj is open; loading verifies the programs and creates the map.
                let e = unsafe { (lib.load)(obj) };
                if e < 0 {
                    bail!(
                        "loading it: {}{}",
                        std::io::Error::from_raw_os_error(-e),
                        log_tail()
                    );
                }
                // SAFETY: map is loaded; this fills the map's value with the programs.
                let link = unsafe { (lib.attach_struct_ops)(map) };
                if link.is_null() {
                    return Err(std::io::Error::last_os_error())
                        .context(format!("filling its struct_ops map{}", log_tail()));
                }
                // SAFETY: link and map are live.
                let (lfd, mfd) = unsafe { ((lib.link_fd)(link), (lib.map_fd)(map)) };
                // libbpf 1.2 and later link a BPF_F_LINK map themselves; 1.1 only fills it.
                let owned = if lfd >= 0 && lfd != mfd {
                    // SAFETY: a link fd libbpf will not close once disconnected.
                    Ok(unsafe { OwnedFd::from_raw_fd(lfd) })
                } else {
                    link_struct_ops(mfd).map_err(|e| match e.raw_os_error() {
                        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                            anyhow!("linking its struct_ops map: {e} (Linux 6.4 or later needed)")
                        }
                        _ => anyhow!("linking its struct_ops map: {e}{}", log_tail()),
                    })
                };
                // SAFETY: the link object is freed without detaching what it made.
                unsafe {
                    (lib.link_disconnect)(link);
                    (lib.link_destroy)(link);
                }
                owned
            })();
            // SAFETY: obj is open and closed once; the registration holds what it needs.
            unsafe { (lib.close)(obj) };
            r
        })();
        // SAFETY: restores the previous callback (libbpf's default when it was None).
        unsafe { (lib.set_print)(old_print) };
        let link = result?;
        if !listed("tcp_available_congestion_control", NAME) {
            bail!("registered, but the kernel does not list {NAME} in net.ipv4.tcp_available_congestion_control");
        }
        Ok(link)
    }
}
