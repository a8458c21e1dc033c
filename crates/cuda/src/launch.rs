//! Kernel launches through `cuLaunchKernelEx`, optionally with programmatic dependent launch
//! (PDL) outside a graph.
//!
//! The decode step gets PDL from its captured graph (every kernel edge made programmatic,
//! [`crate::graph`]). The batched prefill is launched eagerly, one kernel after another with
//! `T` as a host argument, so its kernels would pay a full stream boundary each: the next grid
//! is only set up once the previous one has completed. With the
//! `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` attribute on an eager launch the
//! driver may start the next grid as soon as every block of the previous kernel in the stream
//! has triggered or exited; the new grid's `griddepcontrol.wait` (`calla_pdl_wait` in
//! `kernels/prelude.cuh`) then holds it until the previous grid has completed and its writes
//! are visible. Every kernel launched through [`Launch`] with PDL must therefore call
//! `calla_pdl_wait()` before it reads anything the previous kernels write and before it writes
//! anything (the rule every kernel of this crate follows). Only the dependency on the previous
//! *kernel* is relaxed: memory copies, event waits (`cuStreamWaitEvent`) and host work queued
//! between two launches order the stream as usual (CUDA driver API,
//! `CUlaunchAttributeValue::programmaticStreamSerializationAllowed`).
//!
//! [`CudaContext::kernel`] makes a [`Launch`] on the context's stream, with PDL when the
//! context's eager-PDL switch is on ([`CudaContext::set_eager_pdl`]; the prefill turns it on for
//! its chunks, [`crate::prefill::Prefiller::eager_pdl`]).

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, LaunchConfig};

/// One argument of a [`Launch`]: the address of a value the caller keeps alive, or a device
/// pointer held by the launch itself.
enum Arg {
    Ref(*const c_void),
    Ptr(usize),
}

/// A kernel launch being assembled: the function, its stream, its arguments in parameter order
/// and whether it may overlap the previous kernel (PDL). Arguments are borrowed for `'a`, as
/// with `cudarc`'s `LaunchArgs`; device buffers are passed by their device address
/// ([`Launch::ptr`], [`Launch::ptr_mut`]).
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    args: Vec<Arg>,
    ptrs: Vec<u64>,
    pdl: bool,
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `stream`; `pdl`: with the programmatic-stream-serialization
    /// attribute (see the module docs for what the kernel must then guarantee).
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction, pdl: bool) -> Self {
        Launch { stream, func, args: Vec::with_capacity(24), ptrs: Vec::with_capacity(16), pdl }
    }

    /// Appends a by-value kernel parameter (an integer, a float, a device address already taken,
    /// a `#[repr(C)]` struct the kernel declares with the same layout).
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(Arg::Ref(v as *const T as *const c_void));
        self
    }

    /// Appends the device address of a buffer the kernel only reads.
    pub fn ptr<T, P: DevicePtr<T>>(&mut self, buf: &P) -> &mut Self {
        let (p, _sync) = buf.device_ptr(self.stream);
        self.args.push(Arg::Ptr(self.ptrs.len()));
        self.ptrs.push(p);
        self
    }

    /// Appends the device address of a buffer the kernel writes.
    pub fn ptr_mut<T, P: DevicePtrMut<T>>(&mut self, buf: &mut P) -> &mut Self {
        let (p, _sync) = buf.device_ptr_mut(self.stream);
        self.args.push(Arg::Ptr(self.ptrs.len()));
        self.ptrs.push(p);
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, every buffer
    /// must be large enough for what the kernel reads and writes with `cfg`, and with PDL the
    /// kernel must follow the rule in the module docs.
    ///
    /// # Errors
    /// Driver errors of `cuLaunchKernelEx` (bad configuration, too much shared memory, ...).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match *a {
                Arg::Ref(p) => p as *mut c_void,
                Arg::Ptr(i) => &self.ptrs[i] as *const u64 as *mut c_void,
            })
            .collect();
        // SAFETY: a zeroed attribute is a valid value of the C struct; its id and value are set.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: `params` points at one value per kernel parameter (the caller's contract),
        // each alive until this call returns (the driver copies them at launch); `lc` and `attr`
        // outlive the call.
        unsafe { sys::cuLaunchKernelEx(&lc, self.func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }
}
