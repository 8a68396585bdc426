// SPDX-License-Identifier: GPL-2.0
//! The simulated device's copy channels: `copy_channels` engines per device that run
//! beside everything else, as a real device's DMA engines do. gmem starts a copy on one
//! (`copy_async`) and goes on; the channel runs its copies in order on a work item of the
//! sim's own workqueue (never in the thread that started them), each over the link model
//! (`sim_link.rs`), and completes each copy's fence when its data has landed.
//!
//! **Lifetimes.** A channel is shared (`Arc`) by its device and, while it has work, by its
//! queued work item; a queued copy holds its device (`Arc<SimDev>`), so neither can go
//! while a copy waits. gmem waits for every fence of a device before
//! `gmem_dev_unregister` returns, so no copy is queued after the device is gone; the
//! workqueue ([`Wq`]) belongs to the module and is destroyed last, which drains it: no work
//! item runs module code after unload.
//!
//! **Timing.** A copy's link time is booked when it is started (`Channels::start`), from
//! when both its link and the channel's earlier copies are free: a channel is a queue of
//! descriptors that the engine works through back to back, whichever CPU runs the worker
//! and whenever. The worker moves the data and completes the copy once its booking ended.
//!
//! **Locks.** `Channel::queue` is a leaf, never held while copying or completing (booking
//! a copy under it takes only the link model's atomics).

use crate::gmem::Submission;
use crate::SimDev;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering};
use kernel::{
    bindings, new_mutex,
    prelude::*,
    sync::{Arc, Mutex},
    workqueue::{impl_has_work, new_work, Queue, Work, WorkItem},
};

/// Most channels a device may have (the driver API's limit).
pub(crate) const MAX_CHANNELS: u32 = crate::gmem::abi::GMEM_MAX_CHANNELS;

/// The sim's workqueue: unbound (the channels' copies run on any CPU) and with a rescuer,
/// since gmem may need a copy to complete to reclaim memory.
///
/// # Invariants
/// `0` is a live workqueue from `alloc_workqueue`, destroyed once, on drop.
pub(crate) struct Wq(NonNull<bindings::workqueue_struct>);

// SAFETY: a workqueue may be used and destroyed from any thread.
unsafe impl Send for Wq {}
// SAFETY: as above; queueing is thread-safe.
unsafe impl Sync for Wq {}

impl Wq {
    pub(crate) fn new() -> Result<Wq> {
        let flags = bindings::wq_flags_WQ_UNBOUND | bindings::wq_flags_WQ_MEM_RECLAIM;
        // SAFETY: a plain allocation in process context; the name is a static string
        // without format directives.
        let q = unsafe { bindings::alloc_workqueue_noprof(c"gmem_sim".as_char_ptr(), flags, 0) };
        // INVARIANT: non-null means a live workqueue.
        NonNull::new(q).map(Wq).ok_or(ENOMEM)
    }

    fn raw(&self) -> *mut bindings::workqueue_struct {
        self.0.as_ptr()
    }
}

impl Drop for Wq {
    fn drop(&mut self) {
        // SAFETY: live, destroyed once (type invariant); this waits for every queued item.
        unsafe { bindings::destroy_workqueue(self.0.as_ptr()) };
    }
}

/// Copies started on a channel and not yet run, each with its plan (`SimDev::plan_copy`),
/// and when the last one booked ends its link time.
#[derive(Default)]
struct Pending {
    copies: KVec<(Arc<SimDev>, Submission<SimDev>, crate::CopyPlan)>,
    busy_until: u64,
}

/// One copy engine.
///
/// # Invariants
/// `wq` is the module's [`Wq`], which outlives every use of the channel (see the module
/// documentation).
#[pin_data]
pub(crate) struct Channel {
    wq: *mut bindings::workqueue_struct,
    #[pin]
    queue: Mutex<Pending>,
    #[pin]
    work: Work<Channel>,
}

// SAFETY: `wq` is only passed to the workqueue API, which is thread-safe; the rest is
// `Send + Sync` state.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl_has_work! {
    impl HasWork<Self> for Channel { self.work }
}

impl WorkItem for Channel {
    type Pointer = Arc<Channel>;

    /// Runs the channel's copies in the order they were started, until none is left.
    /// (The work item is no longer pending while it runs, so a copy started meanwhile
    /// queues it again, or is found by the next turn of this loop.) Each copy's link time
    /// was booked when it was started (`Channels::start`), so the worker only moves the
    /// data and waits for the booking to end.
    fn run(ch: Arc<Channel>) {
        loop {
            let batch = core::mem::take(&mut ch.queue.lock().copies);
            if batch.is_empty() {
                return;
            }
            for (dev, sub, plan) in batch {
                // Pages the engine moves: all of them, or those before an injected failure
                // (none if the copy itself failed).
                let (todo, fires) = (plan.todo, plan.fires);
                let r = dev.run_planned(sub.job(), plan);
                let moved = if r.is_ok() || fires { todo } else { 0 };
                dev.chan.async_pages.fetch_add(moved as u64, Ordering::Relaxed);
                dev.chan.inflight.fetch_sub(1, Ordering::Relaxed);
                sub.complete(r);
            }
        }
    }
}

impl Channel {
    fn new(wq: &Wq) -> Result<Arc<Channel>> {
        // INVARIANT: the module's queue (the only `Wq`).
        Arc::pin_init(
            pin_init!(Channel {
                wq: wq.raw(),
                queue <- new_mutex!(Pending::default(), "gmem_sim::Channel::queue"),
                work <- new_work!("gmem_sim::Channel::work"),
            }),
            GFP_KERNEL,
        )
    }
}

/// What the channels of a device have done (`GMEM_SIM_IOC_INFO`).
#[derive(Default)]
pub(crate) struct ChanStats {
    /// Copies started and not completed yet, over all channels.
    pub(crate) inflight: AtomicU64,
    /// Most copies in flight at once so far.
    pub(crate) max_inflight: AtomicU64,
    /// Copy calls started on a channel.
    pub(crate) async_calls: AtomicU64,
    /// Pages copied by the channels' workers (a failed copy counts only the pages it
    /// moved before it failed).
    pub(crate) async_pages: AtomicU64,
}

/// The channels of one device.
pub(crate) struct Channels {
    chans: KVec<Arc<Channel>>,
}

impl Channels {
    /// `n` channels (0: the device copies synchronously, in gmem's thread).
    pub(crate) fn new(wq: &Wq, n: u32) -> Result<Channels> {
        if n > MAX_CHANNELS {
            return Err(EINVAL);
        }
        let mut chans = KVec::with_capacity(n as usize, GFP_KERNEL)?;
        for _ in 0..n {
            chans.push(Channel::new(wq)?, GFP_KERNEL)?;
        }
        Ok(Channels { chans })
    }

    pub(crate) fn len(&self) -> u32 {
        self.chans.len() as u32
    }

    /// Forgets when each channel's last booking ends (a new link model: copies started
    /// from now on no longer queue behind the old model's bookings, as on its paths; copies
    /// already queued keep theirs).
    pub(crate) fn reset_bookings(&self) {
        for ch in self.chans.iter() {
            ch.queue.lock().busy_until = 0;
        }
    }

    /// Queues `sub` on channel `chan` of `dev`. A channel gmem should not have named, or
    /// no memory to queue it, fails the copy (`EINVAL`, `ENOMEM`) at once.
    pub(crate) fn start(&self, dev: &Arc<SimDev>, chan: u32, sub: Submission<SimDev>) {
        let Some(ch) = self.chans.get(chan as usize) else {
            sub.complete(Err(EINVAL));
            return;
        };
        let s = &dev.chan;
        {
            let mut q = ch.queue.lock();
            if let Err(e) = q.copies.reserve(1, GFP_KERNEL) {
                drop(q);
                sub.complete(Err(e.into()));
                return;
            }
            let now = s.inflight.fetch_add(1, Ordering::Relaxed) + 1;
            s.max_inflight.fetch_max(now, Ordering::Relaxed);
            s.async_calls.fetch_add(1, Ordering::Relaxed);
            // The engine takes the copy now, as a DMA engine takes a descriptor: its link
            // time starts when both the link and this channel's earlier copies are done, not
            // when a CPU gets round to moving the data.
            let plan = dev.plan_copy(&sub.job(), q.busy_until);
            if let Some(end) = plan.ends() {
                q.busy_until = end;
            }
            let _ = q.copies.push_within_capacity((dev.clone(), sub, plan));
        }
        // SAFETY: the module's queue, alive while any channel is used (type invariant).
        let wq = unsafe { Queue::from_raw(ch.wq) };
        // Already queued (and not yet running): that run finds this copy.
        let _ = wq.enqueue(ch.clone());
    }
}
