//! The GPU side of the API: a [`Device`] (a cudarc context plus what the dispatcher needs to
//! know of it), tensor views over device memory, and calls ordered on the caller's stream.
//!
//! Nothing here synchronizes the stream: results are ready when the stream says so.

mod combine;
mod fp8;
mod kvcache;
#[cfg(feature = "nccl")]
mod nccl;
mod ring;
#[cfg(feature = "selftest")]
pub(crate) mod selftest;
mod varlen;
mod views;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, DriverError};
pub use fp8::{
    fp8_key_block, fp8_query_block, v_key_column, v_row_head_dim, Fp8ForwardInputs, Fp8Inputs,
    Fp8Options,
};
pub use kvcache::{
    DeviceCacheDescales, DeviceKvCacheAppend, DeviceKvCacheInputs, DeviceKvCacheStep, DeviceRotary,
};
#[cfg(feature = "nccl")]
pub use nccl::{nccl_present, RingComm, RingId};
pub use ring::{DeviceRingGradients, DeviceRingOutput, RingStreams};
pub use varlen::DeviceSeqlens;
pub use views::{
    DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut, DeviceTensor, DeviceTensorMut,
};

use crate::backend::gpu::{self, RawTensor};
use crate::config::{AttentionConfig, Backend};
use crate::dispatch::{self, BuiltKernels, DeviceInfo, Memory, Op, Plan};
use crate::error::{CallPart, Error, Operand, Result};
use crate::ffi;
use crate::tensor::{check_backward, check_forward, check_sinks, DType, Element, Problem};
use views::KeysValues;

/// Is a CUDA driver (libcuda) loadable on this machine? Probed before any driver call, since
/// cudarc panics when the library is missing. Asked of the dynamic loader itself: cudarc's own
/// probe exists only where it loads the driver at run time, and beside a crate that links the
/// driver (candle-core) it links it instead.
pub fn driver_present() -> bool {
    library_loads(&["libcuda.so.1", "libcuda.so"])
}

/// Does the dynamic loader find a library under one of `names`? A handle it returns is closed at
/// once (the library stays loaded where cudarc opened it too).
fn library_loads(names: &[&str]) -> bool {
    extern "C" {
        fn dlopen(filename: *const std::ffi::c_char, flag: std::ffi::c_int) -> *mut c_void;
        fn dlclose(handle: *mut c_void) -> std::ffi::c_int;
    }
    const RTLD_LAZY: std::ffi::c_int = 1;
    names.iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no interior nul");
        // SAFETY: dlopen of a C string that lives across the call; a handle it returns is
        // closed at once.
        unsafe {
            let handle = dlopen(name.as_ptr(), RTLD_LAZY);
            if handle.is_null() {
                return false;
            }
            dlclose(handle);
            true
        }
    })
}

fn driver_error(e: DriverError) -> Error {
    Error::Cuda {
        code: e.0 as i32,
        name: format!("{:?}", e.0),
    }
}

/// Number of CUDA devices, or `NoDevice` when there is no driver.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoDevice(
            "the CUDA driver library is not installed".into(),
        ));
    }
    CudaContext::device_count()
        .map(|n| n as usize)
        .map_err(driver_error)
}

/// Properties of device `ordinal`, through the C ABI's runtime query.
pub fn query_device(ordinal: usize) -> Result<DeviceInfo> {
    let mut raw = ffi::flashattn_device_info_t {
        major: 0,
        minor: 0,
        sm_count: 0,
        max_smem_per_block_optin: 0,
        l2_bytes: 0,
        total_mem_bytes: 0,
        name: [0; 256],
    };
    let index = i32::try_from(ordinal)
        .map_err(|_| Error::NoDevice(format!("device ordinal {ordinal} is out of range")))?;
    // SAFETY: `raw` is a valid out-pointer for the duration of the call.
    let r = unsafe { ffi::flashattn_device_query(index, &mut raw) };
    ffi::check_status(r, "device query")?;
    let name: Vec<u8> = raw
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(DeviceInfo {
        ordinal: index,
        name: String::from_utf8_lossy(&name).into_owned(),
        major: raw.major,
        minor: raw.minor,
        sm_count: raw.sm_count,
        max_smem_per_block_optin: raw.max_smem_per_block_optin as usize,
        l2_bytes: raw.l2_bytes as usize,
    })
}

/// One CUDA device: its context and properties. Calls take the caller's stream.
#[derive(Clone, Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    /// Offset arrays of equal-length entries that KV-cache calls have uploaded, by rows each,
    /// shared by the device's clones (kvcache.rs).
    uniform_offsets: Arc<Mutex<KeptOffsets>>,
}

/// Device offset arrays by rows each, the longest last.
type KeptOffsets = HashMap<usize, Vec<Arc<CudaSlice<i32>>>>;

impl Device {
    /// Opens device `ordinal` (its primary context, which the kernels' runtime also uses).
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error)?;
        let info = query_device(ordinal)?;
        Ok(Device {
            ctx,
            info,
            uniform_offsets: Arc::default(),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// A new non-blocking stream on this device.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(driver_error)
    }

    /// Refuses a stream or view of another CUDA context: the kernels run in this device's
    /// context, where another context's memory is an illegal address (which ends the context)
    /// and another context's stream cannot order them.
    fn check_same_context<'c, P: Into<CallPart>>(
        &self,
        stream: &CudaStream,
        views: impl IntoIterator<Item = (P, &'c Arc<CudaContext>)>,
    ) -> Result<()> {
        let mismatch = |what: CallPart, ctx: &CudaContext| Error::WrongDevice {
            what,
            detail: format!(
                "it belongs to a context of device {}, the call was made on device {}'s \
                 primary context",
                ctx.ordinal(),
                self.info.ordinal
            ),
        };
        if **stream.context() != *self.ctx {
            return Err(mismatch(CallPart::Stream, stream.context()));
        }
        for (operand, ctx) in views {
            if **ctx != *self.ctx {
                return Err(mismatch(operand.into(), ctx));
            }
        }
        Ok(())
    }

    /// The backend a call would take on this device, without running it (a backward that returns
    /// the sinks' gradient: [`Op::BackwardWithSinkGradient`]).
    pub fn plan(&self, op: Op, problem: &Problem, cfg: &AttentionConfig) -> Result<Plan> {
        dispatch::plan(
            op,
            problem,
            cfg,
            &Memory::Device(self.info.clone()),
            BuiltKernels::current(),
        )
    }

    /// Forward pass into caller-owned device outputs, ordered on `stream`.
    /// `lse` is f32 (batch, heads_q, seqlen_q), packed. With sinks, see
    /// [`DeviceForwardInputs::sinks`].
    ///
    /// ```no_run
    /// # use flashattn::cuda::{Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut};
    /// # use flashattn::AttentionConfig;
    /// # fn run(dev: &Device, x: &[half::bf16], shape: [usize; 4]) -> flashattn::Result<()> {
    /// # let stream = dev.new_stream()?;
    /// # let up = |x: &[half::bf16]| stream.clone_htod(x).unwrap();
    /// let (q, k, v, mut o) = (up(x), up(x), up(x), up(x));
    /// let mut lse = stream.alloc_zeros::<f32>(shape[0] * shape[1] * shape[2]).unwrap();
    /// // One sink logit per query head.
    /// let sinks = stream.clone_htod(&vec![0.5f32; shape[2]]).unwrap();
    /// let (q, k, v) = (
    ///     DeviceTensor::contiguous(&q, shape),
    ///     DeviceTensor::contiguous(&k, shape),
    ///     DeviceTensor::contiguous(&v, shape),
    /// );
    /// dev.forward_into(
    ///     &stream,
    ///     &AttentionConfig::new().causal(true),
    ///     DeviceForwardInputs::new(&q, &k, &v).with_sinks(&sinks.as_view()),
    ///     &mut DeviceTensorMut::contiguous(&mut o, shape),
    ///     &mut lse.as_view_mut(),
    /// )?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_into<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: DeviceForwardInputs<'_, T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        self.forward_launch(stream, cfg, None, inputs, out, lse)
    }

    /// The forward of a dense batch, or of a packed one (`seqs`), with or without sinks.
    fn forward_launch<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        inputs: DeviceForwardInputs<'_, T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        let DeviceForwardInputs { q, k, v, sinks } = inputs;
        let kv = KeysValues {
            k,
            v,
            e4m3_descales: None,
        };
        self.forward_launch_over(stream, cfg, seqs, (q, kv, sinks), out, lse)
    }

    /// [`Device::forward_launch`] over K and V of element type `C`: Q's, or an e4m3 KV cache
    /// (a paged packed call's, `seqs`) with its descales, which the Hopper forward widens.
    pub(super) fn forward_launch_over<T: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        (q, kv, sinks): (
            &DeviceTensor<'_, T>,
            KeysValues<'_, C>,
            Option<&CudaView<'_, f32>>,
        ),
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        let KeysValues {
            k,
            v,
            e4m3_descales,
        } = kv;
        let e4m3_cache = C::DTYPE != T::DTYPE;
        if e4m3_cache && (C::DTYPE != DType::E4M3 || seqs.and_then(DeviceSeqlens::pages).is_none())
        {
            return Err(Error::InvalidConfig(format!(
                "K and V of {:?} under Q of {:?}: only an e4m3 KV cache's pages differ from Q",
                C::DTYPE,
                T::DTYPE
            )));
        }
        if T::DTYPE == DType::E4M3 {
            return Err(Error::Unsupported {
                what: "e4m3 operands in forward_into (the FP8 forward takes them through \
                       fp8_inputs_from_e4m3 and forward_fp8_into)"
                    .into(),
                backend: Backend::Sm90,
            });
        }
        self.check_same_context(
            stream,
            [
                (Operand::Q, q.data.stream().context()),
                (Operand::K, k.data.stream().context()),
                (Operand::V, v.data.stream().context()),
                (Operand::Out, out.data.stream().context()),
                (Operand::Lse, lse.stream().context()),
            ],
        )?;
        if let Some(seqs) = seqs {
            self.check_same_context(stream, seqs.contexts())?;
        }
        if let Some(sinks) = sinks {
            self.check_same_context(stream, [(Operand::Sinks, sinks.stream().context())])?;
        }
        if let Some([kd, vd]) = e4m3_descales {
            self.check_same_context(
                stream,
                [
                    (Operand::K, kd.stream().context()),
                    (Operand::V, vd.stream().context()),
                ],
            )?;
        }
        let inputs = [q.operand(), k.operand(), v.operand()];
        let rows = match seqs {
            Some(seqs) => seqs.check_forward(T::DTYPE, inputs, out.operand(), lse.len())?,
            None => check_forward(T::DTYPE, inputs, out.operand(), lse.len())?,
        };
        let problem = match seqs {
            Some(seqs) => seqs.problem(&rows, cfg)?,
            None => rows,
        };
        problem.check_index_width(&[
            (Operand::Q, &q.layout),
            (Operand::K, &k.layout),
            (Operand::V, &v.layout),
            (Operand::Out, &out.layout),
        ])?;
        check_sinks(&problem, sinks.map(|s| s.len()), None)?;

        // The guards make `stream` wait for earlier writers and record this use; they must
        // live until the launch has been enqueued.
        let (q_ptr, _q_guard) = q.data.device_ptr(stream);
        let (k_ptr, _k_guard) = k.data.device_ptr(stream);
        let (v_ptr, _v_guard) = v.data.device_ptr(stream);
        let (o_ptr, _o_guard) = out.data.device_ptr_mut(stream);
        let (lse_ptr, _lse_guard) = lse.device_ptr_mut(stream);
        let (packed, _seqs_guards) = seqs.map(|s| s.rows(stream, &rows)).unzip();
        let (sinks_ptr, _sinks_guard) = sinks.map(|s| s.device_ptr(stream)).unzip();
        let ([kd_ptr, vd_ptr], _descale_guards) = match e4m3_descales {
            Some([kd, vd]) => {
                let ((k, kg), (v, vg)) = (kd.device_ptr(stream), vd.device_ptr(stream));
                ([k, v], Some((kg, vg)))
            }
            None => ([0, 0], None),
        };
        let operands = [
            (
                Operand::Q,
                RawTensor {
                    ptr: q_ptr,
                    layout: q.layout,
                },
            ),
            (
                Operand::K,
                RawTensor {
                    ptr: k_ptr,
                    layout: k.layout,
                },
            ),
            (
                Operand::V,
                RawTensor {
                    ptr: v_ptr,
                    layout: v.layout,
                },
            ),
            (
                Operand::Out,
                RawTensor {
                    ptr: o_ptr,
                    layout: out.layout,
                },
            ),
        ];
        for (operand, t) in &operands {
            let size = match operand {
                Operand::K | Operand::V => std::mem::size_of::<C>(),
                _ => std::mem::size_of::<T>(),
            };
            gpu::check_alignment(*operand, t, size)?;
        }
        let op = if e4m3_cache {
            Op::ForwardOverFp8Cache
        } else {
            Op::Forward
        };
        let plan = self.plan(op, &problem, cfg)?;
        self.ctx.bind_to_thread().map_err(driver_error)?;
        gpu::forward(
            &plan,
            &problem,
            packed.as_ref(),
            cfg,
            self.info.sm_count,
            operands.map(|(_, t)| t),
            gpu::ForwardExtras {
                lse: lse_ptr,
                sinks: sinks_ptr.unwrap_or(0),
                e4m3_descales: e4m3_cache.then_some([kd_ptr, vd_ptr]),
            },
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
        Ok(plan)
    }
}

impl Device {
    /// Backward pass into caller-owned device gradients, ordered on `stream`: recomputes P from
    /// the forward's LSE and writes dQ, dK and dV, and where `grads.dsinks` is given, the
    /// attention sinks' gradient ([`DeviceGradientsMut::dsinks`]; `inputs.sinks` must be those
    /// the forward took). The f32 workspace is allocated on `stream` and freed in stream order.
    ///
    /// ```no_run
    /// # use flashattn::cuda::{Device, DeviceBackwardInputs, DeviceGradientsMut};
    /// # use flashattn::cuda::{DeviceTensor, DeviceTensorMut};
    /// # use flashattn::AttentionConfig;
    /// # fn run(dev: &Device, x: &[half::bf16], shape: [usize; 4]) -> flashattn::Result<()> {
    /// # let stream = dev.new_stream()?;
    /// # let up = |x: &[half::bf16]| stream.clone_htod(x).unwrap();
    /// // Q, K, V, the forward's O and LSE, and dO, from earlier calls on `stream`:
    /// # let (q, k, v, o, d_o) = (up(x), up(x), up(x), up(x), up(x));
    /// # let lse = stream.alloc_zeros::<f32>(shape[0] * shape[1] * shape[2]).unwrap();
    /// let (mut dq, mut dk, mut dv) = (up(x), up(x), up(x));
    /// let plan = dev.backward_into(
    ///     &stream,
    ///     &AttentionConfig::new().causal(true),
    ///     DeviceBackwardInputs {
    ///         q: &DeviceTensor::contiguous(&q, shape),
    ///         k: &DeviceTensor::contiguous(&k, shape),
    ///         v: &DeviceTensor::contiguous(&v, shape),
    ///         out: &DeviceTensor::contiguous(&o, shape),
    ///         dout: &DeviceTensor::contiguous(&d_o, shape),
    ///         lse: &lse.as_view(),
    ///         sinks: None,
    ///     },
    ///     DeviceGradientsMut {
    ///         dq: &mut DeviceTensorMut::contiguous(&mut dq, shape),
    ///         dk: &mut DeviceTensorMut::contiguous(&mut dk, shape),
    ///         dv: &mut DeviceTensorMut::contiguous(&mut dv, shape),
    ///         dsinks: None,
    ///     },
    /// )?;
    /// println!("{}", plan.explain());
    /// # Ok(())
    /// # }
    /// ```
    pub fn backward_into<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: DeviceBackwardInputs<'_, T>,
        grads: DeviceGradientsMut<'_, '_, T>,
    ) -> Result<Plan> {
        self.backward_launch(stream, cfg, None, inputs, grads, None)
    }

    /// The backward of a dense batch, or of a packed one (`seqs`), with or without sinks (and
    /// their gradient's buffer), its workspace in `workspace` where that holds enough (a caller
    /// that must not allocate once it has begun, as a ring's step), else taken on `stream`.
    fn backward_launch<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        inputs: DeviceBackwardInputs<'_, T>,
        grads: DeviceGradientsMut<'_, '_, T>,
        workspace: Option<&mut CudaSlice<u8>>,
    ) -> Result<Plan> {
        let DeviceBackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse,
            sinks,
        } = inputs;
        let DeviceGradientsMut { dq, dk, dv, dsinks } = grads;
        self.check_same_context(
            stream,
            [
                (Operand::Q, q.data.stream().context()),
                (Operand::K, k.data.stream().context()),
                (Operand::V, v.data.stream().context()),
                (Operand::Out, out.data.stream().context()),
                (Operand::DOut, dout.data.stream().context()),
                (Operand::Lse, lse.stream().context()),
                (Operand::DQ, dq.data.stream().context()),
                (Operand::DK, dk.data.stream().context()),
                (Operand::DV, dv.data.stream().context()),
            ],
        )?;
        if let Some(seqs) = seqs {
            self.check_same_context(stream, seqs.contexts())?;
        }
        if let Some(sinks) = sinks {
            self.check_same_context(stream, [(Operand::Sinks, sinks.stream().context())])?;
        }
        if let Some(dsinks) = &dsinks {
            self.check_same_context(stream, [(Operand::DSinks, dsinks.stream().context())])?;
        }
        let rows = check_backward(
            T::DTYPE,
            [
                q.operand(),
                k.operand(),
                v.operand(),
                out.operand(),
                dout.operand(),
            ],
            lse.len(),
            [dq.operand(), dk.operand(), dv.operand()],
        )?;
        let problem = match seqs {
            Some(seqs) => seqs.problem(&rows, cfg)?,
            None => rows,
        };
        problem.check_index_width(&[
            (Operand::Q, &q.layout),
            (Operand::K, &k.layout),
            (Operand::V, &v.layout),
            (Operand::Out, &out.layout),
            (Operand::DOut, &dout.layout),
            (Operand::DQ, &dq.layout),
            (Operand::DK, &dk.layout),
            (Operand::DV, &dv.layout),
        ])?;
        check_sinks(
            &problem,
            sinks.map(|s| s.len()),
            dsinks.as_ref().map(|s| s.len()),
        )?;
        let op = if dsinks.is_some() {
            Op::BackwardWithSinkGradient
        } else {
            Op::Backward
        };
        let plan = self.plan(op, &problem, cfg)?;
        self.ctx.bind_to_thread().map_err(driver_error)?;
        let (packed, _seqs_guards) = seqs.map(|s| s.rows(stream, &rows)).unzip();
        let workspace_bytes = gpu::bwd_workspace_bytes(
            &problem,
            packed.as_ref(),
            plan.backend,
            cfg.deterministic,
            self.info.sm_count,
            dsinks.is_some(),
        );
        // SAFETY: the kernels zero what they accumulate into and write the rest before reading.
        let mut taken;
        let mut workspace = match workspace {
            Some(held) if held.len() >= workspace_bytes => held.slice_mut(..workspace_bytes),
            _ => {
                taken = unsafe { stream.alloc::<u8>(workspace_bytes) }.map_err(driver_error)?;
                taken.slice_mut(..)
            }
        };

        let (q_ptr, _q_guard) = q.data.device_ptr(stream);
        let (k_ptr, _k_guard) = k.data.device_ptr(stream);
        let (v_ptr, _v_guard) = v.data.device_ptr(stream);
        let (o_ptr, _o_guard) = out.data.device_ptr(stream);
        let (do_ptr, _do_guard) = dout.data.device_ptr(stream);
        let (lse_ptr, _lse_guard) = lse.device_ptr(stream);
        let (dq_ptr, _dq_guard) = dq.data.device_ptr_mut(stream);
        let (dk_ptr, _dk_guard) = dk.data.device_ptr_mut(stream);
        let (dv_ptr, _dv_guard) = dv.data.device_ptr_mut(stream);
        let (ws_ptr, _ws_guard) = workspace.device_ptr_mut(stream);
        let (sinks_ptr, _sinks_guard) = sinks.map(|s| s.device_ptr(stream)).unzip();
        let (dsinks_ptr, _dsinks_guard) = dsinks.map(|s| s.device_ptr_mut(stream)).unzip();
        let raw = |ptr, layout| RawTensor { ptr, layout };
        let ops = gpu::BackwardOperands {
            q: raw(q_ptr, q.layout),
            k: raw(k_ptr, k.layout),
            v: raw(v_ptr, v.layout),
            out: raw(o_ptr, out.layout),
            dout: raw(do_ptr, dout.layout),
            dq: raw(dq_ptr, dq.layout),
            dk: raw(dk_ptr, dk.layout),
            dv: raw(dv_ptr, dv.layout),
            lse: lse_ptr,
            sinks: sinks_ptr.unwrap_or(0),
            dsinks: dsinks_ptr.unwrap_or(0),
            workspace: ws_ptr,
            workspace_bytes,
        };
        let size = std::mem::size_of::<T>();
        for (operand, t) in [
            (Operand::Q, &ops.q),
            (Operand::K, &ops.k),
            (Operand::V, &ops.v),
            (Operand::Out, &ops.out),
            (Operand::DOut, &ops.dout),
            (Operand::DQ, &ops.dq),
            (Operand::DK, &ops.dk),
            (Operand::DV, &ops.dv),
        ] {
            gpu::check_alignment(operand, t, size)?;
        }
        gpu::backward(
            plan.backend,
            &problem,
            packed.as_ref(),
            cfg,
            self.info.sm_count,
            &ops,
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
        Ok(plan)
    }
}

/// The kernels' alignment (16-byte base pointers and strides) of tensors, as a call checks them:
/// for callers that refuse a misaligned one before work the call would follow.
pub(super) fn check_aligned<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    tensors: &[(Operand, &DeviceTensor<'_, T>)],
) -> Result<()> {
    for &(operand, t) in tensors {
        let (ptr, _guard) = t.data.device_ptr(stream);
        let raw = RawTensor {
            ptr,
            layout: t.layout,
        };
        gpu::check_alignment(operand, &raw, std::mem::size_of::<T>())?;
    }
    Ok(())
}

/// [`check_aligned`] of an output.
pub(super) fn check_aligned_out<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    operand: Operand,
    t: &DeviceTensorMut<'_, T>,
) -> Result<()> {
    let (ptr, _guard) = t.data.device_ptr(stream);
    let raw = RawTensor {
        ptr,
        layout: t.layout,
    };
    gpu::check_alignment(operand, &raw, std::mem::size_of::<T>())
}
