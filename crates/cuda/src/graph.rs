//! A captured CUDA graph whose kernel-to-kernel edges can be made *programmatic* (Hopper's
//! programmatic dependent launch, PDL): a dependent kernel is scheduled as soon as every block
//! of its predecessor has called `griddepcontrol.launch_dependents` (or exited), runs its
//! prologue (e.g. starts streaming its weights), and blocks in `griddepcontrol.wait` until the
//! predecessor has completed and its memory is visible. That hides most of the launch gap
//! between the many small kernels of a batch-1 decode step.
//!
//! Correctness rule for every kernel in a PDL graph (`kernels/prelude.cuh`): each thread calls
//! `calla_pdl_wait()` before it reads anything an earlier kernel wrote, before it writes any
//! buffer (an earlier kernel may still be reading or writing it), and before it exits, even when
//! it has nothing to do — completion then stays transitive along the chain of kernels, so a
//! kernel may read the output of any earlier kernel, not only its direct predecessor. The one
//! documented exception: a kernel may read, before its wait, state that only it writes (the GDN
//! decode step prefetches its own recurrent and conv state, `kernels/gdn.cu`).
//!
//! cudarc's `CudaStream::end_capture` instantiates at once, so the capture and instantiation are
//! done here with the driver API directly.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaStream, DriverError};

use crate::CudaError;

fn check(r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver(DriverError(r)))
    }
}

/// A kernel for [`StepGraph::capture_with_root`]: entry point, blocks of `block` threads (no
/// dynamic shared memory), and its arguments in order, each in the low bytes of one `u64`
/// (pointers as device addresses; 4-byte integers as their value).
pub struct RootKernel {
    /// The loaded entry point.
    pub func: sys::CUfunction,
    /// Blocks (one-dimensional grid).
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// The kernel's arguments in order, one per slot.
    pub args: Vec<u64>,
}

/// An instantiated graph captured from one stream; launched on the same stream.
pub struct StepGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
    /// Kernel-to-kernel edges made programmatic.
    pub programmatic_edges: usize,
    /// Kernel nodes captured from the stream (the root kernel of
    /// [`Self::capture_with_root`] not counted).
    pub kernels: usize,
    /// Root kernels added beside the captured ones (0 or 1).
    pub root_kernels: usize,
}

// SAFETY: the handles are only used through &self/&mut self with the stream they belong to;
// the driver API is thread-safe for these calls.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Captures what `enqueue` queues on `stream` into a graph and instantiates it. With `pdl`,
    /// every edge between two kernel nodes becomes a programmatic dependency (see the module
    /// docs for the rule kernels must follow).
    ///
    /// # Errors
    /// The error of `enqueue` (the capture is ended and discarded first), or driver errors.
    pub fn capture(
        stream: &Arc<CudaStream>,
        pdl: bool,
        enqueue: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<StepGraph, CudaError> {
        Self::capture_with_root(stream, pdl, enqueue, None)
    }

    /// [`Self::capture`], then `root` added as a kernel node with no dependencies: it starts
    /// with the graph, runs beside the captured chain, and the graph completes when both have
    /// (the L2 follower, [`crate::follow`]). It gets no programmatic edge.
    ///
    /// # Errors
    /// As [`Self::capture`].
    pub fn capture_with_root(
        stream: &Arc<CudaStream>,
        pdl: bool,
        enqueue: impl FnOnce() -> Result<(), CudaError>,
        root: Option<RootKernel>,
    ) -> Result<StepGraph, CudaError> {
        let s = stream.cu_stream();
        stream.context().bind_to_thread()?;
        // SAFETY: plain driver calls on a live stream; the graph is destroyed on every path.
        unsafe {
            check(sys::cuStreamBeginCapture_v2(
                s,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ))?;
            let queued = enqueue();
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            let ended = check(sys::cuStreamEndCapture(s, &mut graph));
            if let Err(e) = queued.and(ended) {
                if !graph.is_null() {
                    sys::cuGraphDestroy(graph);
                }
                return Err(e);
            }
            let mut g = StepGraph {
                graph,
                exec: std::ptr::null_mut(),
                stream: stream.clone(),
                programmatic_edges: 0,
                kernels: 0,
                root_kernels: 0,
            };
            g.kernels = g.kernel_nodes()?;
            if pdl {
                g.programmatic_edges = g.make_edges_programmatic()?;
            }
            if let Some(r) = root {
                // every argument in its own 8-byte slot; the driver copies them at the call
                let mut slots = r.args;
                let mut ptrs: Vec<*mut std::ffi::c_void> = slots.iter_mut().map(|a| a as *mut u64 as *mut std::ffi::c_void).collect();
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
                p.func = r.func;
                (p.gridDimX, p.gridDimY, p.gridDimZ) = (r.grid, 1, 1);
                (p.blockDimX, p.blockDimY, p.blockDimZ) = (r.block, 1, 1);
                p.sharedMemBytes = 0;
                p.kernelParams = ptrs.as_mut_ptr();
                let mut node: sys::CUgraphNode = std::ptr::null_mut();
                check(sys::cuGraphAddKernelNode_v2(&mut node, g.graph, std::ptr::null(), 0, &p))?;
                g.root_kernels = 1;
            }
            check(sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0))?;
            Ok(g)
        }
    }

    fn nodes(&self) -> Result<Vec<sys::CUgraphNode>, CudaError> {
        let mut n = 0usize;
        // SAFETY: size query, then a buffer of that size.
        unsafe {
            check(sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n))?;
            let mut v = vec![std::ptr::null_mut(); n];
            check(sys::cuGraphGetNodes(self.graph, v.as_mut_ptr(), &mut n))?;
            v.truncate(n);
            Ok(v)
        }
    }

    fn is_kernel(node: sys::CUgraphNode) -> Result<bool, CudaError> {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of a live graph.
        unsafe { check(sys::cuGraphNodeGetType(node, &mut t))? };
        Ok(t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
    }

    fn kernel_nodes(&self) -> Result<usize, CudaError> {
        let mut k = 0;
        for n in self.nodes()? {
            if Self::is_kernel(n)? {
                k += 1;
            }
        }
        Ok(k)
    }

    /// Replaces each kernel→kernel edge with a programmatic one; returns how many.
    fn make_edges_programmatic(&mut self) -> Result<usize, CudaError> {
        let mut n = 0usize;
        // SAFETY: size query, then buffers of that size; edges of a live, not yet instantiated
        // graph are removed and re-added one at a time.
        unsafe {
            check(sys::cuGraphGetEdges_v2(
                self.graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut n,
            ))?;
            let mut from = vec![std::ptr::null_mut(); n];
            let mut to = vec![std::ptr::null_mut(); n];
            let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
            check(sys::cuGraphGetEdges_v2(
                self.graph,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut n,
            ))?;
            let mut changed = 0;
            for i in 0..n {
                if !(Self::is_kernel(from[i])? && Self::is_kernel(to[i])?) {
                    continue;
                }
                check(sys::cuGraphRemoveDependencies_v2(self.graph, &from[i], &to[i], &data[i], 1))?;
                let mut e: sys::CUgraphEdgeData = std::mem::zeroed();
                e.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
                e.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
                check(sys::cuGraphAddDependencies_v2(self.graph, &from[i], &to[i], &e, 1))?;
                changed += 1;
            }
            Ok(changed)
        }
    }

    /// The kernel nodes in launch order (a topological order of the graph, ties broken by
    /// creation order; a captured single-stream step is a chain): entry point name and blocks
    /// per grid. For [`crate::timeline::layout`].
    ///
    /// # Errors
    /// Driver errors.
    pub fn kernel_launches(&self) -> Result<Vec<(String, u64)>, CudaError> {
        let nodes = self.nodes()?;
        let index: std::collections::HashMap<usize, usize> = nodes.iter().enumerate().map(|(i, n)| (*n as usize, i)).collect();
        let mut n = 0usize;
        // SAFETY: size query, then buffers of that size, on a live graph.
        let (from, to) = unsafe {
            check(sys::cuGraphGetEdges_v2(self.graph, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), &mut n))?;
            let mut from = vec![std::ptr::null_mut(); n];
            let mut to = vec![std::ptr::null_mut(); n];
            let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
            check(sys::cuGraphGetEdges_v2(self.graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n))?;
            from.truncate(n);
            to.truncate(n);
            (from, to)
        };
        let mut indeg = vec![0usize; nodes.len()];
        let mut out: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        for (f, t) in from.iter().zip(&to) {
            let (f, t) = (index[&(*f as usize)], index[&(*t as usize)]);
            out[f].push(t);
            indeg[t] += 1;
        }
        let mut ready: std::collections::BTreeSet<usize> = (0..nodes.len()).filter(|&i| indeg[i] == 0).collect();
        let mut launches = Vec::new();
        while let Some(i) = ready.pop_first() {
            for &t in &out[i] {
                indeg[t] -= 1;
                if indeg[t] == 0 {
                    ready.insert(t);
                }
            }
            if !Self::is_kernel(nodes[i])? {
                continue;
            }
            // SAFETY: a kernel node of a live graph; the name is a static string of its module.
            unsafe {
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
                check(sys::cuGraphKernelNodeGetParams_v2(nodes[i], &mut p))?;
                let mut name: *const std::ffi::c_char = std::ptr::null();
                let name = if !p.func.is_null() && sys::cuFuncGetName(&mut name, p.func) == sys::CUresult::CUDA_SUCCESS && !name.is_null() {
                    std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned()
                } else {
                    "?".to_string()
                };
                launches.push((name, p.gridDimX as u64 * p.gridDimY as u64 * p.gridDimZ as u64));
            }
        }
        Ok(launches)
    }

    /// Queues one replay on the capture stream.
    ///
    /// # Errors
    /// Driver errors.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: a live instantiated graph and its stream.
        unsafe { check(sys::cuGraphLaunch(self.exec, self.stream.cu_stream())) }
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: handles created in `capture`, destroyed once.
        unsafe {
            if !self.exec.is_null() {
                sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
