//! Every kernel source compiles with NVRTC for sm_90a. Needs `libnvrtc` (see
//! `cuda::nvrtc::INSTALL_HINT`; `.ci/run` installs it) but no GPU and no driver: nothing here
//! initialises the CUDA driver. Fails, never skips, when NVRTC is missing.

#[test]
fn every_kernel_compiles_for_sm_90a() {
    let (ma, mi) = match cuda::nvrtc::ensure_loaded() {
        Ok(v) => v,
        Err(e) => panic!("cannot compile the CUDA kernels: {e}"),
    };
    assert!(ma >= 13, "NVRTC {ma}.{mi}: CUDA 13 is required");
    // development aid: CALLA_COMPILE_ONLY=gemm compiles that one source (with
    // CALLA_PTXAS_VERBOSE, its ptxas report alone); a name that is no source fails
    let only = std::env::var("CALLA_COMPILE_ONLY").ok();
    if let Some(o) = only.as_deref() {
        assert!(cuda::KERNELS.iter().any(|k| k.name == o), "CALLA_COMPILE_ONLY={o}: no kernel source of that name");
    }
    for k in cuda::KERNELS.iter().filter(|k| only.as_deref().is_none_or(|o| o == k.name)) {
        let src = cuda::full_source(k);
        let cubin =
            cuda::nvrtc::compile_cubin(k.name, &src, cuda::ARCH).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{}: not an ELF cubin", k.name);
        // the cubin's kernel entry points, both ways equal to the list the runtime loads: an
        // entry point missing from `entries` cannot be launched (CudaContext::func fails at
        // run time), a listed name missing from the cubin fails at load
        let mut found = entry_points(&cubin);
        found.sort();
        let mut listed: Vec<String> = k.entries.iter().map(|e| e.to_string()).collect();
        listed.sort();
        assert_eq!(found, listed, "{}: the cubin's kernel entry points (left) differ from KernelSource::entries (right)", k.name);
        eprintln!(
            "{}.cu: {} bytes of sm_90a cubin (NVRTC {ma}.{mi})",
            k.name,
            cubin.len()
        );
    }
}

/// The names of a cubin's kernel entry points: its global function symbols marked
/// `STO_CUDA_ENTRY` (0x10 in `st_other`), which `__global__` functions carry and `__device__`
/// functions do not.
fn entry_points(cubin: &[u8]) -> Vec<String> {
    use object::read::elf::{ElfFile64, Sym};
    use object::{Object, ObjectSymbol};
    const STO_CUDA_ENTRY: u8 = 0x10;
    let elf = ElfFile64::<object::Endianness>::parse(cubin).unwrap_or_else(|e| panic!("cubin: not a 64-bit ELF: {e}"));
    elf.symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.is_global() && s.elf_symbol().st_other() & STO_CUDA_ENTRY != 0)
        .map(|s| s.name().expect("symbol name").to_string())
        .collect()
}

/// The timeline probe (`CALLA_TIMELINE`, `cuda::timeline`) compiles into every kernel file and
/// defines the symbol the host writes.
#[test]
fn every_kernel_compiles_with_the_timeline_probe() {
    cuda::nvrtc::ensure_loaded().unwrap_or_else(|e| panic!("cannot compile the CUDA kernels: {e}"));
    for k in cuda::KERNELS {
        let src = cuda::full_source_with(k, true);
        assert!(src.contains("#define CALLA_TIMELINE 1"));
        let cubin = cuda::nvrtc::compile_cubin(k.name, &src, cuda::ARCH).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.windows(9).any(|w| w == b"calla_tl\0"), "{}: no calla_tl symbol in the probed cubin", k.name);
    }
}

#[test]
fn dims_header_comes_from_spec() {
    let h = cuda::dims_header();
    assert!(h.contains(&format!(
        "#define CALLA_D_MODEL {}\n",
        spec::production::D_MODEL
    )));
    assert!(h.contains(&format!(
        "#define CALLA_D_EXPERT {}\n",
        spec::production::D_EXPERT
    )));
    for k in cuda::KERNELS {
        // kernels spell no dimension themselves
        let body = k
            .src
            .replace("_k512", "")
            .replace("_k2048", "")
            .replace("_k4096", ""); // entry names
        for n in ["2048", "4096", "248320"] {
            assert!(
                !body.contains(n),
                "{}.cu spells the dimension {n}; use the dims header",
                k.name
            );
        }
    }
}

#[test]
fn cache_key_changes_with_source() {
    let a = cuda::nvrtc::fnv1a64(&[b"abc", b"sm_90a"]);
    let b = cuda::nvrtc::fnv1a64(&[b"abd", b"sm_90a"]);
    let c = cuda::nvrtc::fnv1a64(&[b"ab", b"csm_90a"]);
    assert_ne!(a, b);
    assert_ne!(a, c);
}

/// `nvrtc::precompile_into` writes the cubin under the name the runtime's cache looks up, and a
/// second call finds it there instead of compiling again.
#[test]
fn precompile_fills_the_cache_the_runtime_reads() {
    cuda::nvrtc::ensure_loaded().unwrap_or_else(|e| panic!("cannot compile the CUDA kernels: {e}"));
    let k = cuda::KERNELS.iter().find(|k| k.name == "sample").expect("the sample kernel file");
    let dir = std::env::temp_dir().join(format!("calla-precompile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = cuda::nvrtc::precompile_into(&dir, std::slice::from_ref(k)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.len(), 1);
    let (path, compiled) = &first[0];
    assert!(*compiled, "an empty folder must be compiled into");
    let cubin = std::fs::read(path).expect("the cubin was written");
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF cubin");
    // the runtime's lookup (cache_path) gives the same file name
    let runtime = cuda::nvrtc::cache_path(k).unwrap_or_else(|e| panic!("{e}"));
    if let Some(rp) = runtime {
        assert_eq!(rp.file_name(), path.file_name(), "precompiled name differs from the runtime's");
    }
    let second = cuda::nvrtc::precompile_into(&dir, std::slice::from_ref(k)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second, vec![(path.clone(), false)], "a cached cubin must not be compiled again");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several kernel files on parallel compile threads: every one compiled into the empty folder,
/// an ELF cubin under the runtime's cache name holding its own file's entry points and none of
/// the others' (a cubin written under another file's name fails it; the order of the results
/// the threads hand back is `nvrtc`'s unit test).
#[test]
fn precompile_on_threads_fills_every_file_in_order() {
    cuda::nvrtc::ensure_loaded().unwrap_or_else(|e| panic!("cannot compile the CUDA kernels: {e}"));
    let names = ["sample", "stream", "rms_norm"];
    let ks: Vec<cuda::KernelSource> = names
        .iter()
        .map(|n| *cuda::KERNELS.iter().find(|k| k.name == *n).expect("kernel file"))
        .collect();
    let dir = std::env::temp_dir().join(format!("calla-precompile-threads-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = cuda::nvrtc::precompile_into_threads(&dir, &ks, 3).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.len(), names.len());
    for ((path, compiled), k) in out.iter().zip(&ks) {
        assert!(*compiled, "{}: an empty folder must be compiled into", k.name);
        let file = path.file_name().and_then(|f| f.to_str()).expect("file name");
        assert!(file.starts_with(&format!("{}-", k.name)), "{file}: results out of order");
        let cubin = std::fs::read(path).expect("the cubin was written");
        assert_eq!(&cubin[..4], b"\x7fELF", "{file}: not an ELF cubin");
        let has = |entry: &str| {
            let sym = format!("\0{entry}\0");
            cubin.windows(sym.len()).any(|w| w == sym.as_bytes())
        };
        for other in &ks {
            for entry in other.entries {
                assert_eq!(has(entry), other.name == k.name, "{file}: entry point {entry} of {}.cu", other.name);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file that does not compile, among others on parallel threads: the error names it and
/// carries NVRTC's log; the files that compiled are still written.
#[test]
fn precompile_on_threads_names_the_file_that_fails() {
    cuda::nvrtc::ensure_loaded().unwrap_or_else(|e| panic!("cannot compile the CUDA kernels: {e}"));
    let good = *cuda::KERNELS.iter().find(|k| k.name == "stream").expect("kernel file");
    let broken = cuda::KernelSource { name: "broken_probe", src: "extern \"C\" __global__ void k() { undeclared_thing(); }\n", entries: &["k"] };
    let dir = std::env::temp_dir().join(format!("calla-precompile-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let err = cuda::nvrtc::precompile_into_threads(&dir, &[broken, good], 2).expect_err("a broken file must fail");
    let msg = err.to_string();
    assert!(msg.contains("broken_probe.cu does not compile"), "{msg}");
    assert!(msg.contains("undeclared_thing"), "NVRTC's log is missing: {msg}");
    // the file after the broken one was compiled and kept: asking again compiles nothing
    let again = cuda::nvrtc::precompile_into_threads(&dir, &[good], 2).unwrap_or_else(|e| panic!("{e}"));
    assert!(!again[0].1, "stream.cu was not stored beside the failure");
    let _ = std::fs::remove_dir_all(&dir);
}
