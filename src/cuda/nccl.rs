//! The device ring across devices: one rank a device (a thread or process each), the K and V
//! shards and the backward's dK and dV sums handed on between them by NCCL send and receive
//! (cudarc's bindings to the library, loaded at run time), on the ring's transport stream. The
//! schedule is the one-device ring's ([`Device::ring_forward_into`]), call for call; only the
//! rotation differs: there a copy between simulated ranks' buffers, here a grouped send to
//! the next rank and receive from the one before.
//!
//! Every rank of a ring must make the same call (shapes, type, mask, sharding, sinks) at the
//! same step of its program. Each call first checks its own part (its tensors, their alignment,
//! every pair's plan) and takes every buffer its steps need (the backward's workspace
//! included), then the ranks gather, on the communicator's own stream and buffers, each one's
//! account of the call and whether it can go on (one host synchronization a call): a call that
//! some rank makes differently, or cannot make, is refused on every rank, rather than left
//! waiting for a transfer that never comes. An error after that, while the transfers are issued
//! (a launch that fails), leaves the other ranks waiting, as a failed NCCL collective does: the
//! failing rank's communicator is then broken (it takes no more calls and is aborted, not
//! finalized, when dropped), and the application ends the ring's processes. NCCL's destroy and
//! abort wait for every rank of the node: each rank drops its own communicator, in its own
//! thread.

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void, CStr};
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
};
use cudarc::nccl::{result, sys};

use super::ring::{RingRank, RingStreams, Rotation};
use super::{
    driver_error, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceRingGradients,
    DeviceRingOutput,
};
use crate::config::AttentionConfig;
use crate::dispatch::Plan;
use crate::error::{CallPart, Error, Result};
use crate::ring::Sharding;
use crate::Element;

/// A call's account (call_words): its type, sharding, direction, sinks, configuration and the
/// Q, K and V shapes; the agreement adds whether the rank refused it.
const CALL_WORDS: usize = 5 + 12;
const AGREEMENT_WORDS: usize = 1 + CALL_WORDS;

/// The name cudarc loads the library by (its first candidate).
const LIBRARY: &str = "libnccl.so";

/// Is the NCCL library loadable here under the name cudarc asks for? Probed before any NCCL
/// call, since cudarc panics when the library is missing, as `driver_present` probes the driver.
pub fn nccl_present() -> bool {
    super::library_loads(&[LIBRARY])
}

fn require_library() -> Result<()> {
    if nccl_present() {
        return Ok(());
    }
    Err(Error::Nccl {
        what: "the library is not loadable".into(),
        detail: format!(
            "{LIBRARY} is not on the library path (NVIDIA's nvidia-nccl wheels ship \
             libnccl.so.2: link it as {LIBRARY} in a directory of LD_LIBRARY_PATH)"
        ),
    })
}

/// An NCCL failure as the crate's error: what failed, and NCCL's text for its code.
fn nccl_error(what: &str, e: result::NcclError) -> Error {
    // SAFETY: ncclGetErrorString returns a static C string for any code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    Error::Nccl {
        what: what.into(),
        detail: format!("{:?}: {}", e.0, text.to_string_lossy()),
    }
}

/// Communicators are ready when their init returns: non-blocking ones (NCCL_COMM_BLOCKING=0)
/// would still be connecting, and are aborted.
fn require_ready(status: result::NcclStatus, comms: &[sys::ncclComm_t]) -> Result<()> {
    if status == result::NcclStatus::Success {
        return Ok(());
    }
    // Each in a thread of its own: an abort waits for the node's other ranks to abort theirs.
    let comms: Vec<usize> = comms.iter().map(|&c| c as usize).collect();
    std::thread::scope(|s| {
        for &comm in &comms {
            // SAFETY: communicators just made, which nothing else holds.
            s.spawn(move || unsafe { result::comm_abort(comm as sys::ncclComm_t) });
        }
    });
    Err(Error::Nccl {
        what: "the communicator's init has not completed".into(),
        detail: "non-blocking communicators (NCCL_COMM_BLOCKING=0) are not supported".into(),
    })
}

/// The identity of a ring's communicator, which one rank makes ([`RingId::new`]) and every
/// rank passes to [`RingComm::new`]: 128 bytes to carry between processes as the caller's
/// launcher does (a file, a socket, an environment variable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingId {
    bytes: [u8; 128],
}

impl RingId {
    /// A new identity (NCCL's unique id: it names this host's bootstrap address).
    pub fn new() -> Result<RingId> {
        require_library()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
        Ok(RingId {
            bytes: id.internal.map(|c| c as u8),
        })
    }

    pub fn from_bytes(bytes: [u8; 128]) -> RingId {
        RingId { bytes }
    }

    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.bytes
    }
}

/// One rank's communicator of a ring over devices: its rank, the ring's size and its device.
/// Calls take it by reference and it is not `Sync`: NCCL takes one caller at a time on a
/// communicator. Dropping it destroys the communicator once the work queued on it is done, or
/// aborts it if a ring call failed midway (see the module's documentation); either waits for
/// the other ranks of the node to drop theirs, so each rank drops its own in its own thread.
#[derive(Debug)]
pub struct RingComm {
    comm: sys::ncclComm_t,
    rank: usize,
    count: usize,
    ordinal: i32,
    agreement: Agreement,
    broken: Cell<bool>,
}

/// Where the ranks agree on each call: a stream of the device apart from the caller's, and
/// buffers taken with the communicator (so that a rank short of memory still joins the gather).
#[derive(Debug)]
struct Agreement {
    stream: Arc<CudaStream>,
    mine: RefCell<CudaSlice<u64>>,
    all: RefCell<CudaSlice<u64>>,
}

impl Agreement {
    fn new(device: &Device, count: usize) -> Result<Agreement> {
        let stream = device.new_stream()?;
        let zeros = |n: usize| stream.alloc_zeros::<u64>(n).map_err(driver_error);
        Ok(Agreement {
            mine: RefCell::new(zeros(AGREEMENT_WORDS)?),
            all: RefCell::new(zeros(AGREEMENT_WORDS * count)?),
            stream,
        })
    }
}

// SAFETY: the communicator may move to another thread (NCCL allows any thread to use it, one at
// a time, which `&self` calls of a type that is not `Sync` ensure).
unsafe impl Send for RingComm {}

impl RingComm {
    /// Rank `rank` of a ring of `count` ranks named `id`, on `device`. Every rank must call this
    /// (each in its own thread or process): it returns once all have (a rank that fails before
    /// it joins, short of device memory, leaves the others waiting).
    pub fn new(device: &Device, rank: usize, count: usize, id: &RingId) -> Result<RingComm> {
        require_library()?;
        if rank >= count {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} of a ring of {count} ranks"
            )));
        }
        let (Ok(rank_i), Ok(count_i)) = (c_int::try_from(rank), c_int::try_from(count)) else {
            return Err(Error::InvalidConfig(format!(
                "a ring of {count} ranks passes NCCL's int"
            )));
        };
        // NCCL takes the thread's current device: this device's primary context.
        device.ctx.bind_to_thread().map_err(driver_error)?;
        let id = sys::ncclUniqueId {
            internal: id.bytes.map(|b| b as std::ffi::c_char),
        };
        let agreement = Agreement::new(device, count)?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer for the call.
        let status = unsafe { result::comm_init_rank(&mut comm, count_i, id, rank_i) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        require_ready(status, &[comm])?;
        Ok(RingComm {
            comm,
            rank,
            count,
            ordinal: device.info.ordinal,
            agreement,
            broken: Cell::new(false),
        })
    }

    /// One communicator a device, rank i on `devices[i]`, made by this thread (NCCL's
    /// ncclCommInitAll): for one process driving every device of the ring, each moved to a
    /// thread of its own, which makes the rank's calls and drops it (ring calls and drops of
    /// different ranks wait for one another).
    pub fn for_devices(devices: &[Device]) -> Result<Vec<RingComm>> {
        require_library()?;
        let ordinals: Vec<c_int> = devices.iter().map(|d| d.info.ordinal).collect();
        let Ok(count) = c_int::try_from(devices.len()) else {
            return Err(Error::InvalidConfig(format!(
                "a ring of {} devices passes NCCL's int",
                devices.len()
            )));
        };
        if count == 0 {
            return Err(Error::InvalidConfig("a ring of no devices".into()));
        }
        let agreements: Vec<Agreement> = devices
            .iter()
            .map(|d| Agreement::new(d, devices.len()))
            .collect::<Result<_>>()?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one communicator a device, `ordinals` one entry a device.
        let status = unsafe { result::comm_init_all(comms.as_mut_ptr(), count, ordinals.as_ptr()) }
            .map_err(|e| nccl_error("ncclCommInitAll", e))?;
        require_ready(status, &comms)?;
        Ok(comms
            .into_iter()
            .zip(ordinals.into_iter().zip(agreements))
            .enumerate()
            .map(|(rank, (comm, (ordinal, agreement)))| RingComm {
                comm,
                rank,
                count: devices.len(),
                ordinal,
                agreement,
                broken: Cell::new(false),
            })
            .collect())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// The communicator is `device`'s, whose calls it carries.
    fn check_device(&self, device: &Device) -> Result<()> {
        if self.ordinal == device.info.ordinal {
            return Ok(());
        }
        Err(Error::WrongDevice {
            what: CallPart::Stream,
            detail: format!(
                "the ring's communicator is device {}'s, the call was made on device {}",
                self.ordinal, device.info.ordinal
            ),
        })
    }

    /// Runs `issue` between ncclGroupStart and ncclGroupEnd (which ends the group whatever
    /// `issue` returned).
    fn grouped(&self, issue: impl FnOnce() -> Result<()>) -> Result<()> {
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
        let issued = issue();
        let ended = result::group_end().map_err(|e| nccl_error("ncclGroupEnd", e));
        issued.and(ended.map(drop))
    }

    /// Every rank's `mine` gathered, rank by rank, on the agreement's stream (which this
    /// synchronizes).
    fn gather(&self, mine: &[u64; AGREEMENT_WORDS]) -> Result<Vec<u64>> {
        let Agreement {
            stream,
            mine: sent,
            all,
        } = &self.agreement;
        let (mut sent, mut all) = (sent.borrow_mut(), all.borrow_mut());
        stream.memcpy_htod(mine, &mut *sent).map_err(driver_error)?;
        {
            let (send, _send) = sent.device_ptr(stream);
            let (recv, _recv) = all.device_ptr_mut(stream);
            // SAFETY: AGREEMENT_WORDS u64 to send, `count` times that to receive, in buffers
            // the communicator owns; the copy below waits for the gather.
            unsafe {
                result::all_gather(
                    send as *const c_void,
                    recv as *mut c_void,
                    AGREEMENT_WORDS,
                    sys::ncclDataType_t::ncclUint64,
                    self.comm,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(|e| nccl_error("ncclAllGather", e))?;
        }
        let mut gathered = vec![0; AGREEMENT_WORDS * self.count];
        stream
            .memcpy_dtoh(&*all, &mut gathered)
            .map_err(driver_error)?;
        Ok(gathered)
    }

    /// Whether every rank goes on with a call it describes by `words`: each rank's words and
    /// whether it `refused` the call are gathered, and a call that some rank refused or
    /// describes differently is refused on every rank (the refusing rank's own error on that
    /// rank). A gather that fails breaks the communicator.
    fn agree(&self, words: &[u64; CALL_WORDS], refused: Option<&Error>) -> Result<()> {
        let mut mine = [0; AGREEMENT_WORDS];
        mine[0] = u64::from(refused.is_some());
        mine[1..].copy_from_slice(words);
        let gathered = self.gather(&mine).inspect_err(|_| {
            // The other ranks may be waiting in this gather, or line up their next one with it.
            self.broken.set(true);
        })?;
        if let Some(e) = refused {
            return Err(e.clone());
        }
        for (r, theirs) in gathered.chunks(AGREEMENT_WORDS).enumerate() {
            if theirs[0] != 0 {
                return Err(Error::InvalidConfig(format!(
                    "rank {r} of the ring cannot make this call, so rank {} does not either",
                    self.rank
                )));
            }
            if theirs[1..] != *words {
                return Err(Error::InvalidConfig(format!(
                    "rank {r} of the ring makes another call than rank {} (shapes, type, mask, \
                     sinks or sharding differ)",
                    self.rank
                )));
            }
        }
        Ok(())
    }
}

impl Drop for RingComm {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and used by no other call (&mut self). A failure
        // here has no caller to report to. Destroying finalizes first, which waits for every
        // transfer queued; a ring that failed midway has some that will never complete.
        let _ = unsafe {
            if self.broken.get() {
                result::comm_abort(self.comm)
            } else {
                result::comm_destroy(self.comm)
            }
        };
    }
}

/// A ring's account of one call that every rank must share: its type, sharding, direction,
/// whether it has sinks, the Q, K and V shapes, and a hash of the configuration's description
/// (mask, window, scale, softcap: calls that mean the same but are configured apart, a causal
/// mask against the window it amounts to, are refused, never run apart).
fn call_words(
    dtype: crate::tensor::DType,
    sharding: Sharding,
    shapes: [[usize; 4]; 3],
    cfg: &AttentionConfig,
    (backward, sinks): (bool, bool),
) -> [u64; CALL_WORDS] {
    // FNV-1a: the same bits on every rank for the same description.
    let hash = format!("{cfg:?}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    let mut words = [0; CALL_WORDS];
    words[..5].copy_from_slice(&[
        dtype as u64,
        sharding.chunks_per_rank() as u64,
        u64::from(backward),
        u64::from(sinks),
        hash,
    ]);
    for (w, &n) in words[5..].iter_mut().zip(shapes.iter().flatten()) {
        *w = n as u64;
    }
    words
}

/// The NCCL rotation: the one rank held here sends to the next rank and receives from the one
/// before, both buffers in one group. `words` describe the call (call_words); `refused` is an
/// error met before the schedule's own checks (the communicator of another device);
/// `transferring` says whether the ranks have agreed to run the call and not all its transfers
/// are issued yet (an error then leaves the other ranks waiting).
struct NcclRotation<'c> {
    comm: &'c RingComm,
    words: [u64; CALL_WORDS],
    refused: Option<Error>,
    transferring: Cell<bool>,
}

impl Rotation for NcclRotation<'_> {
    fn count(&self) -> usize {
        self.comm.count
    }

    fn rank(&self, _: usize) -> usize {
        self.comm.rank
    }

    fn check_held(&self, held: usize) -> Result<()> {
        if held == 1 {
            return Ok(());
        }
        Err(Error::InvalidConfig(format!(
            "{held} ranks held by one rank of an NCCL ring"
        )))
    }

    fn agree(&self, refused: Option<&Error>) -> Result<()> {
        self.comm
            .agree(&self.words, self.refused.as_ref().or(refused))?;
        self.transferring.set(true);
        Ok(())
    }

    fn settled(&self) {
        self.transferring.set(false);
    }

    fn rotate<E: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        from: &[[CudaView<E>; 2]],
        into: &mut [[CudaViewMut<E>; 2]],
    ) -> Result<()> {
        let (count, rank) = (self.comm.count, self.comm.rank);
        let (next, before) = ((rank + 1) % count, (rank + count - 1) % count);
        let bytes = |n: usize| n * std::mem::size_of::<E>();
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        // The buffers' stream guards, dropped once the group has ended: the transfers are
        // queued on the stream by ncclGroupEnd, and cudarc orders later users after that.
        if let Some((send, recv)) = from[0]
            .iter()
            .zip(into[0].iter())
            .find(|(send, recv)| send.len() != recv.len())
        {
            return Err(Error::InvalidConfig(format!(
                "a ring buffer of {} elements sent where {} are received",
                send.len(),
                recv.len()
            )));
        }
        let mut guards = vec![];
        self.comm.grouped(|| {
            for (send, recv) in from[0].iter().zip(into[0].iter_mut()) {
                let (send_bytes, recv_bytes) = (bytes(send.len()), bytes(recv.len()));
                let (src, src_guard) = send.device_ptr(stream);
                let (dst, dst_guard) = recv.device_ptr_mut(stream);
                guards.extend([src_guard, dst_guard]);
                // SAFETY: both buffers are live for the whole transfer: the ring keeps them until
                // its compute stream has waited for the transport's work. The peers' sizes agree
                // (RingComm::agree).
                unsafe {
                    result::send(
                        src as *const c_void,
                        send_bytes,
                        sys::ncclDataType_t::ncclUint8,
                        next as c_int,
                        self.comm.comm,
                        cu_stream,
                    )
                }
                .map_err(|e| nccl_error("ncclSend", e))?;
                // SAFETY: as for the send.
                unsafe {
                    result::recv(
                        dst as *mut c_void,
                        recv_bytes,
                        sys::ncclDataType_t::ncclUint8,
                        before as c_int,
                        self.comm.comm,
                        cu_stream,
                    )
                }
                .map_err(|e| nccl_error("ncclRecv", e))?;
            }
            Ok(())
        })
    }
}

impl Device {
    /// [`Device::ring_forward_into`] for one rank of a ring across devices: this rank's shards
    /// (as [`crate::ring::shard`] cuts them for rank `comm.rank()` of `comm.count()`) and its
    /// outputs; K and V travel by NCCL on `streams.transport`. Every rank of the ring makes the
    /// same call at once (see the module's documentation for what is checked).
    pub fn ring_forward_nccl<T: Element + DeviceRepr>(
        &self,
        comm: &RingComm,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        rank: DeviceForwardInputs<'_, T>,
        output: &mut DeviceRingOutput<'_, '_, T>,
    ) -> Result<Plan> {
        let words = call_words(
            T::DTYPE,
            sharding,
            rank.shapes(),
            cfg,
            (false, rank.ring_sinks()),
        );
        comm.run(self, words, |rotation| {
            self.ring_forward_with(
                rotation,
                streams,
                cfg,
                sharding,
                std::slice::from_ref(&rank),
                std::slice::from_mut(output),
            )
        })
    }

    /// [`Device::ring_backward_into`] for one rank of a ring across devices, as
    /// [`Device::ring_forward_nccl`] runs the forward: the dK and dV sums travel by NCCL with
    /// the shards and come home to their rank after the last step.
    pub fn ring_backward_nccl<T: Element + DeviceRepr>(
        &self,
        comm: &RingComm,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        rank: DeviceBackwardInputs<'_, T>,
        grads: &mut DeviceRingGradients<'_, '_, T>,
    ) -> Result<Plan> {
        let words = call_words(
            T::DTYPE,
            sharding,
            rank.shapes(),
            cfg,
            (true, rank.ring_sinks()),
        );
        comm.run(self, words, |rotation| {
            self.ring_backward_with(
                rotation,
                streams,
                cfg,
                sharding,
                std::slice::from_ref(&rank),
                std::slice::from_mut(grads),
            )
        })
    }
}

impl RingComm {
    /// One ring call on `device`, described by `words` (call_words), run by `schedule` over this
    /// communicator's rotation. A broken communicator takes no more calls (its peers wait on
    /// transfers of the call that broke it); a call that fails while its transfers are issued
    /// breaks it.
    fn run<X>(
        &self,
        device: &Device,
        words: [u64; CALL_WORDS],
        schedule: impl FnOnce(&NcclRotation<'_>) -> Result<X>,
    ) -> Result<X> {
        if self.broken.get() {
            return Err(Error::Nccl {
                what: "the communicator is broken".into(),
                detail: "a ring call failed midway on it: drop it and end the ring's processes"
                    .into(),
            });
        }
        let rotation = NcclRotation {
            comm: self,
            words,
            refused: self.check_device(device).err(),
            transferring: Cell::new(false),
        };
        let result = schedule(&rotation);
        if result.is_err() && rotation.transferring.get() {
            self.broken.set(true);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    /// A call's account is the same for the same call, made anew (as on another rank), and
    /// differs with each thing the ranks must share: type, sharding, direction, sinks, mask,
    /// any shape.
    #[test]
    fn a_calls_account_tells_calls_apart() {
        let shapes = [[1, 64, 4, 64], [1, 64, 2, 64], [1, 64, 2, 64]];
        let causal = AttentionConfig::new().causal(true);
        let account = |dtype, sharding, shapes, cfg: &AttentionConfig, dir| {
            call_words(dtype, sharding, shapes, cfg, dir)
        };
        let base = account(
            DType::BF16,
            Sharding::ZigZag,
            shapes,
            &causal,
            (false, false),
        );
        let again = AttentionConfig::new().causal(true);
        assert_eq!(
            base,
            account(
                DType::BF16,
                Sharding::ZigZag,
                shapes,
                &again,
                (false, false)
            )
        );
        let mut other_shape = shapes;
        other_shape[2][3] = 128;
        for other in [
            account(
                DType::F16,
                Sharding::ZigZag,
                shapes,
                &causal,
                (false, false),
            ),
            account(
                DType::BF16,
                Sharding::Contiguous,
                shapes,
                &causal,
                (false, false),
            ),
            account(
                DType::BF16,
                Sharding::ZigZag,
                shapes,
                &causal,
                (true, false),
            ),
            account(
                DType::BF16,
                Sharding::ZigZag,
                shapes,
                &causal,
                (false, true),
            ),
            account(
                DType::BF16,
                Sharding::ZigZag,
                shapes,
                &AttentionConfig::new(),
                (false, false),
            ),
            account(
                DType::BF16,
                Sharding::ZigZag,
                other_shape,
                &causal,
                (false, false),
            ),
        ] {
            assert_ne!(base, other);
        }
    }

    /// Where libnccl.so is not loadable (CI's machines), asking for a ring is a typed error
    /// naming the library, not cudarc's panic; where it is, the GPU tests take over.
    #[test]
    fn a_missing_library_is_a_typed_error() {
        if nccl_present() {
            return;
        }
        match RingId::new() {
            Err(Error::Nccl { what, detail }) => {
                assert!(what.contains("not loadable"), "{what}");
                assert!(detail.contains(LIBRARY), "{detail}");
            }
            other => panic!("expected a typed NCCL error, got {other:?}"),
        }
    }
}
