//! NVRTC: loading the library, compiling a kernel source to an `sm_90a` cubin, and the on-disk
//! cache. Nothing here touches the CUDA driver, so it runs on machines without a GPU (CI).
//!
//! **Finding `libnvrtc`.** cudarc loads `libnvrtc.so.13` (and other names) through the dynamic
//! linker, so `LD_LIBRARY_PATH` works. Before that, [`ensure_loaded`] looks for the library by
//! full path in `$CALLA_NVRTC_DIR` and in `<workspace>/target/nvrtc/nvidia/cu13/lib` (where
//! `.ci/run` installs the PyPI wheel `nvidia-cuda-nvrtc`), and loads `libnvrtc-builtins` and
//! `libnvrtc` from there first; the later load by name then finds the already-loaded library by
//! its soname.
//!
//! **Cache.** A cubin is stored as `<cache>/<name>-<arch>-<hash>.cubin`, where `hash` is the
//! 64-bit FNV-1a of the full source (dims header included), the architecture, the compile
//! options and the NVRTC version. `<cache>` is `$CALLA_CUDA_CACHE`, else
//! `$XDG_CACHE_HOME/calla/cuda`, else `$HOME/.cache/calla/cuda`. Files are written to a
//! temporary name and renamed, so concurrent processes never read a partial cubin. A cache
//! that cannot be written is not an error (the cubin is just not kept).

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::{full_source, CudaError, KernelSource, ARCH};

/// Options passed to NVRTC for every kernel (the architecture is added after them).
pub const OPTIONS: &[&str] = &["-std=c++17", "--fmad=true", "-default-device", "-lineinfo"];

/// How to get NVRTC, printed when it cannot be loaded.
pub const INSTALL_HINT: &str = "NVRTC (libnvrtc.so.13) not found. Install the PyPI wheel: \
`python3 -m pip install --target target/nvrtc nvidia-cuda-nvrtc==13.0.88` (from the workspace \
root), or set CALLA_NVRTC_DIR to a folder holding libnvrtc.so.13, or add that folder to \
LD_LIBRARY_PATH (a CUDA 13 toolkit has it in /usr/local/cuda/lib64).";

fn candidate_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = std::env::var_os("CALLA_NVRTC_DIR") {
        v.push(PathBuf::from(d));
    }
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    v.push(ws.join("target/nvrtc/nvidia/cu13/lib"));
    v
}

/// Makes sure `libnvrtc` can be used: preloads it from the known folders (module docs), then
/// asks cudarc to load it and reads its version. Returns `(major, minor)`.
///
/// # Errors
/// [`CudaError::Nvrtc`] with [`INSTALL_HINT`] when no library is found.
pub fn ensure_loaded() -> Result<(i32, i32), CudaError> {
    static VERSION: OnceLock<Result<(i32, i32), String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            for dir in candidate_dirs() {
                let lib = dir.join("libnvrtc.so.13");
                if !lib.is_file() {
                    continue;
                }
                // Builtins first, so libnvrtc's own dlopen of them finds the loaded one.
                if let Ok(rd) = std::fs::read_dir(&dir) {
                    for e in rd.flatten() {
                        let n = e.file_name().to_string_lossy().into_owned();
                        if n.starts_with("libnvrtc-builtins.so") {
                            // SAFETY: loading a shared library; its initialisers are NVIDIA's.
                            if let Ok(l) = unsafe { libloading::Library::new(e.path()) } {
                                std::mem::forget(l);
                            }
                        }
                    }
                }
                // SAFETY: as above.
                if let Ok(l) = unsafe { libloading::Library::new(&lib) } {
                    std::mem::forget(l);
                    break;
                }
            }
            // cudarc panics when it finds no library; turn that into an error.
            let r = std::panic::catch_unwind(|| {
                let (mut a, mut b) = (0, 0);
                // SAFETY: plain out-parameters.
                let res = unsafe { sys::nvrtcVersion(&mut a, &mut b) };
                (res, a, b)
            });
            match r {
                Ok((sys::nvrtcResult::NVRTC_SUCCESS, a, b)) => Ok((a, b)),
                Ok((res, _, _)) => Err(format!("nvrtcVersion failed: {res:?}")),
                Err(_) => Err(INSTALL_HINT.to_string()),
            }
        })
        .clone()
        .map_err(CudaError::Nvrtc)
}

/// 64-bit FNV-1a.
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Compiles CUDA C++ `src` to a cubin for `arch` (e.g. `sm_90a`). No driver needed.
///
/// # Errors
/// [`CudaError::Nvrtc`] with NVRTC's log when the source does not compile.
pub fn compile_cubin(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    ensure_loaded()?;
    let e = |what: &str, r: sys::nvrtcResult| CudaError::Nvrtc(format!("{name}: {what}: {r:?}"));
    let c_src = CString::new(src).map_err(|_| CudaError::Nvrtc("NUL in source".into()))?;
    let c_name = CString::new(format!("{name}.cu")).map_err(|_| CudaError::Nvrtc(format!("NUL in the kernel file name {name:?}")))?;
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            c_src.as_ptr(),
            c_name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(e("nvrtcCreateProgram", r));
    }
    let mut opts: Vec<CString> = OPTIONS
        .iter()
        .map(|o| CString::new(*o).expect("opt"))
        .collect();
    opts.push(CString::new(format!("--gpu-architecture={arch}")).expect("arch"));
    // development aid: ptxas's per-kernel registers, spills and shared memory on stderr (the
    // cache key does not include it: clear the cache or use compile_cubin directly)
    let verbose = std::env::var_os("CALLA_PTXAS_VERBOSE").is_some();
    if verbose {
        opts.push(CString::new("--ptxas-options=--verbose").expect("opt"));
    }
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: prog is valid; the option strings outlive the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let log = program_log(prog);
    if verbose && r == sys::nvrtcResult::NVRTC_SUCCESS {
        eprintln!("{name}.cu (ptxas):\n{log}");
    }
    let out = if r != sys::nvrtcResult::NVRTC_SUCCESS {
        Err(CudaError::Nvrtc(format!(
            "{name}.cu does not compile for {arch} ({r:?}):\n{log}"
        )))
    } else {
        let mut size = 0usize;
        // SAFETY: prog compiled successfully.
        let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            Err(e(
                "nvrtcGetCUBINSize (is the architecture a real sm_XX?)",
                r,
            ))
        } else {
            let mut buf = vec![0u8; size];
            // SAFETY: buf has `size` bytes.
            let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                Err(e("nvrtcGetCUBIN", r))
            } else {
                Ok(buf)
            }
        }
    };
    // SAFETY: prog is valid and not used afterwards.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    out
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: prog valid.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: buf has `size` bytes.
    unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) };
    CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The cache folder (module docs).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CALLA_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("calla/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/calla/cuda"))
}

/// The cache file name of `k`'s cubin (`<name>-<arch>-<hash>.cubin`, module docs).
fn cache_file_name(k: &KernelSource) -> Result<String, CudaError> {
    let (ma, mi) = ensure_loaded()?;
    let src = full_source(k);
    let h = fnv1a64(&[
        src.as_bytes(),
        ARCH.as_bytes(),
        OPTIONS.join(" ").as_bytes(),
        format!("{ma}.{mi}").as_bytes(),
    ]);
    Ok(format!("{}-{ARCH}-{h:016x}.cubin", k.name))
}

/// Where the cubin of `k` is (or would be) cached; `None` when no cache folder is known.
pub fn cache_path(k: &KernelSource) -> Result<Option<PathBuf>, CudaError> {
    let name = cache_file_name(k)?;
    Ok(cache_dir().map(|d| d.join(name)))
}

/// Compiles each kernel file of `kernels` into the cache folder `dir` under the name the
/// runtime looks for ([`cache_path`] with `$CALLA_CUDA_CACHE` = `dir`), skipping those already
/// there. Needs NVRTC but no GPU and no driver, so the cache of a GPU machine can be filled on
/// another machine with the same NVRTC major.minor version (the version is part of the key;
/// another version just compiles again there). Returns, per kernel file, the cubin's path and
/// whether it was compiled now (`false`: it was cached already). The files compile on
/// [`compile_threads`] threads.
///
/// # Errors
/// [`CudaError::Nvrtc`] when NVRTC is missing, a kernel does not compile, or `dir` or a cubin
/// in it cannot be written (the message names the path); the first such file in `kernels`'
/// order. The files that did compile are written either way.
pub fn precompile_into(dir: &Path, kernels: &[KernelSource]) -> Result<Vec<(PathBuf, bool)>, CudaError> {
    precompile_into_threads(dir, kernels, compile_threads())
}

/// [`precompile_into`] on at most `threads` compile threads (0 or 1: one file after another).
///
/// # Errors
/// As [`precompile_into`]; when several files fail, the first of them in `kernels`' order. The
/// files that did compile are written either way.
pub fn precompile_into_threads(
    dir: &Path,
    kernels: &[KernelSource],
    threads: usize,
) -> Result<Vec<(PathBuf, bool)>, CudaError> {
    std::fs::create_dir_all(dir).map_err(|e| CudaError::Nvrtc(format!("cannot create cache folder {}: {e}", dir.display())))?;
    let mut out = Vec::with_capacity(kernels.len());
    let mut jobs = Vec::new();
    for k in kernels {
        let path = dir.join(cache_file_name(k)?);
        let cached = std::fs::metadata(&path).is_ok_and(|m| m.len() > 0);
        if !cached {
            jobs.push((k, Some(path.clone())));
        }
        out.push((path, !cached));
    }
    let mut first_err = None;
    for ((_, path), (cubin, written)) in jobs.iter().zip(compile_and_store(&jobs, threads)) {
        let r = cubin.and_then(|_| {
            let path = path.as_deref().expect("every job has its path");
            written.map_err(|e| CudaError::Nvrtc(format!("cannot write {}: {e}", path.display())))
        });
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(out), Err)
}

/// One kernel file's cubin, or why it has none.
type Compiled = Result<Vec<u8>, CudaError>;

/// How many kernel files NVRTC compiles at once: `$CALLA_NVRTC_THREADS` when it is a whole
/// number ≥ 1 (1 compiles them one after another), else (unset, 0 or not a number) the
/// machine's available parallelism.
pub fn compile_threads() -> usize {
    std::env::var("CALLA_NVRTC_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Compiles the kernel file of every job for [`ARCH`] ([`compile_cubin`]) on up to `threads`
/// threads, each taking the next file not yet taken, and writes each cubin that compiled to its
/// job's cache file, if it has one (also when another file failed). Per job, in order: the
/// cubin or why it did not compile, and whether it was written (`Ok` without a cache file).
///
/// Every call of [`compile_cubin`] creates, compiles and destroys its own NVRTC program, so no
/// program is shared between threads. NVRTC's output is not byte-identical from one compile to
/// the next for some files even one at a time (the PTX it embeds for `-lineinfo` numbers
/// registers differently), so kernels compiled this way were checked by running them: every
/// self-test section and `calla cuda-check` on an H100 (docs/CUDA.md, "NVRTC cache"). There the
/// 12 files took 80.2 s on 16 cores against 109.8 s one after another; the largest (`gemm.cu`)
/// sets the time when every file has a core. A panic in a compile thread is passed on.
fn compile_and_store(jobs: &[(&KernelSource, Option<PathBuf>)], threads: usize) -> Vec<(Compiled, std::io::Result<()>)> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let one = |i: usize| {
        let (k, path) = &jobs[i];
        let cubin = compile_cubin(k.name, &full_source(k), ARCH);
        let written = match (&cubin, path) {
            (Ok(c), Some(p)) => store_cubin(p, c),
            _ => Ok(()),
        };
        (cubin, written)
    };
    let threads = threads.min(jobs.len());
    if threads <= 1 {
        return (0..jobs.len()).map(one).collect();
    }
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<(Compiled, std::io::Result<()>)>> = jobs.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= jobs.len() {
                            break done;
                        }
                        done.push((i, one(i)));
                    }
                })
            })
            .collect();
        for w in workers {
            for (i, r) in w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)) {
                results[i] = Some(r);
            }
        }
    });
    results.into_iter().map(|r| r.expect("every job is taken by one worker")).collect()
}

/// The cubins of the kernel files `kernels` for [`ARCH`], in their order: each from the cache
/// when present, the others compiled with NVRTC on [`compile_threads`] threads
/// ([`compile_and_store`]) and stored (a cache that cannot be written is not an error).
///
/// # Errors
/// [`CudaError::Nvrtc`] when NVRTC is missing or a kernel does not compile (the first such
/// file in `kernels`' order).
pub fn compile_all_cached(kernels: &[KernelSource]) -> Result<Vec<Vec<u8>>, CudaError> {
    let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(kernels.len());
    let mut slots = Vec::new();
    let mut jobs = Vec::new();
    for k in kernels {
        let path = cache_path(k)?;
        let cached = path.as_ref().and_then(|p| std::fs::read(p).ok()).filter(|b| !b.is_empty());
        if cached.is_none() {
            slots.push(out.len());
            jobs.push((k, path));
        }
        out.push(cached);
    }
    let mut first_err = None;
    // a cache that cannot be written is not an error: the write's outcome is dropped
    for (i, (cubin, _written)) in slots.into_iter().zip(compile_and_store(&jobs, compile_threads())) {
        match cubin {
            Ok(c) => out[i] = Some(c),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(out.into_iter().map(|c| c.expect("every kernel cached or compiled")).collect())
}

/// Writes `cubin` to the cache file `path` (its folder created if missing) through a temporary
/// name and a rename, so that a concurrent reader never sees a partial cubin.
fn store_cubin(path: &Path, cubin: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, cubin)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Results come back in the jobs' order, whichever thread finishes first: each cubin holds
    /// its own file's entry points and none of the others' (the largest file first, so results
    /// in finishing order would be out of place).
    #[test]
    fn compile_and_store_keeps_the_jobs_order() {
        ensure_loaded().unwrap_or_else(|e| panic!("cannot compile the CUDA kernels: {e}"));
        let ks: Vec<&KernelSource> = ["sample", "stream", "rms_norm"]
            .iter()
            .map(|n| crate::KERNELS.iter().find(|k| k.name == *n).expect("kernel file"))
            .collect();
        let jobs: Vec<(&KernelSource, Option<PathBuf>)> = ks.iter().map(|k| (*k, None)).collect();
        let out = compile_and_store(&jobs, 3);
        assert_eq!(out.len(), ks.len());
        for ((cubin, written), k) in out.into_iter().zip(&ks) {
            let cubin = cubin.unwrap_or_else(|e| panic!("{e}"));
            assert!(written.is_ok(), "{}: nothing to write, nothing may fail", k.name);
            let has = |entry: &str| {
                let sym = format!("\0{entry}\0");
                cubin.windows(sym.len()).any(|w| w == sym.as_bytes())
            };
            for other in &ks {
                for entry in other.entries {
                    assert_eq!(has(entry), other.name == k.name, "{}'s cubin: entry point {entry} of {}.cu", k.name, other.name);
                }
            }
        }
    }
}
