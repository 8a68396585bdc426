// SPDX-License-Identifier: GPL-2.0
//! The simulated device's copy channels: `copy_channels` engines per device that run
//! beside everything else, as a real device's DMA engines do. gmem starts a copy on one
//! (`copy_async`) and goes on; the channel moves its copies' data in order on a work item of
//! the sim's own workqueue (never in the thread that started them), each over the link
//! model (`sim_link.rs`), and completes each copy's fence when its data has landed and its
//! link time has ended.
//!
//! **Timing.** A copy's link time is booked when it is started (`Channels::start`), from
//! when both its link and the channel's earlier copies are free: a channel is a queue of
//! descriptors that the engine works through back to back, whichever CPU runs the worker
//! and whenever. The worker moves the data; if the booking has not ended by then, the copy
//! waits in the channel's landing list and the channel's timer completes it when the
//! booking ends, from interrupt context (hard; softirq on PREEMPT_RT), as a real
//! engine's completion interrupt would (`gmem_fence_signal` may be called from any
//! context). So the fence is signalled one wake-up after the booking ends (gmem's
//! waiter's), not two (the worker's, then the waiter's): under TCG each wake-up of an idle
//! vCPU costs 0.1-1 ms.
//!
//! **Polling.** When a copy is started, the channel tells gmem when its booking ends
//! (`Submission::expect_in`), and gmem's waiter may then complete it itself from shortly
//! before that time on: `copy_poll` completes, in the caller's thread, what the timer
//! would complete if it fired now (`Channel::complete_due`, counted as `polled`). Either
//! takes a copy out of the landing list under `landed` before it signals it, so each copy
//! is signalled once; the timer left armed for a copy a poll took finds the next one, or
//! none, when it fires.
//!
//! **Lifetimes.** A channel is shared (`Arc`) by its device and, while it has work, by its
//! queued work item; a queued or landing copy holds its device (`Arc<SimDev>`), so neither
//! can go while a copy waits. gmem waits for every fence of a device before
//! `gmem_dev_unregister` returns, so no copy is queued or landing after the device is gone.
//! The timer is armed while the landing list is not empty (and may still fire once with
//! the list empty, after a poll took the copy it was armed for), and a channel cancels it
//! when it is dropped (`hrtimer_cancel` waits for a running callback), so the callback never
//! runs on a freed channel. The callback drops a landing copy's device reference before it
//! signals the fence: never the last one (the module keeps every device, and the
//! registration's reference lasts until unregistration, which waits for that fence). The
//! workqueue ([`Wq`]) belongs to the module and is destroyed last, which drains it: no work
//! item runs module code after unload.
//!
//! **Locks.** `Channel::queue` is never held while copying or completing; booking a copy
//! under it takes only the link model's path lock (`PathState::booked`, a leaf).
//! `Channel::landed` (interrupts off) is taken by the worker, the timer callback and
//! `copy_poll` (gmem's waiter, in process context, under gmem's block lock); under it
//! only the timer is (re)armed (the hrtimer base lock nests inside it); no fence is
//! signalled under it.

use crate::gmem::Submission;
use crate::SimDev;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering};
use kernel::{
    bindings, impl_has_hr_timer, new_mutex, new_spinlock_irq,
    prelude::*,
    sync::{Arc, Mutex, SpinLockIrq},
    time::{
        hrtimer::{AbsoluteMode, HasHrTimer, HrTimer, HrTimerCallback, HrTimerCallbackContext, HrTimerRestart},
        Instant, Monotonic,
    },
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

/// Whether instant `a` comes before `b` (instants of a clock are not ordered by type).
fn before(a: Instant<Monotonic>, b: Instant<Monotonic>) -> bool {
    (a - b).is_negative()
}

/// A copy whose data has moved and whose link time ends at `at`: completed then by the
/// channel's timer.
struct Landing {
    at: Instant<Monotonic>,
    dev: Arc<SimDev>,
    sub: Submission<SimDev>,
    /// Pages the engine moved (counted when the copy completes).
    moved: usize,
    r: Result,
}

impl Landing {
    /// Counts the copy and signals its fence (any context: see the module documentation
    /// for why dropping `dev` here never drops the last reference).
    fn finish(self) {
        let Landing { dev, sub, moved, r, .. } = self;
        dev.chan.async_pages.fetch_add(moved as u64, Ordering::Relaxed);
        dev.chan.inflight.fetch_sub(1, Ordering::Relaxed);
        drop(dev);
        sub.complete(r);
    }
}

/// The copies of a channel waiting for their link time to end, earliest first, and when
/// the timer is armed for (`None`: not armed).
#[derive(Default)]
struct Landed {
    copies: KVec<Landing>,
    armed: Option<Instant<Monotonic>>,
}

/// One copy engine.
///
/// # Invariants
/// `wq` is the module's [`Wq`], which outlives every use of the channel (see the module
/// documentation). `timer` is armed while `landed` holds a copy (it may also be armed with
/// none, when a poll took the copy it was set for), and is cancelled before the channel is
/// freed (its drop).
#[pin_data(PinnedDrop)]
pub(crate) struct Channel {
    wq: *mut bindings::workqueue_struct,
    #[pin]
    queue: Mutex<Pending>,
    #[pin]
    work: Work<Channel>,
    #[pin]
    landed: SpinLockIrq<Landed>,
    #[pin]
    timer: HrTimer<Channel>,
}

// SAFETY: `wq` is only passed to the workqueue API, which is thread-safe; the rest is
// `Send + Sync` state.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl_has_work! {
    impl HasWork<Self> for Channel { self.work }
}

impl_has_hr_timer! {
    impl HasHrTimer<Self> for Channel { mode: AbsoluteMode<Monotonic>, field: self.timer }
}

impl WorkItem for Channel {
    type Pointer = Arc<Channel>;

    /// Runs the channel's copies in the order they were started, until none is left.
    /// (The work item is no longer pending while it runs, so a copy started meanwhile
    /// queues it again, or is found by the next turn of this loop.) Each copy's link time
    /// was booked when it was started (`Channels::start`), so the worker only moves the
    /// data; a copy whose booking has not ended yet lands for the timer to complete.
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
                let r = dev.move_data(sub.job(), &plan);
                let moved = if r.is_ok() || fires { todo } else { 0 };
                let now = Instant::now();
                let at = dev.landing_at(&plan).filter(|at| before(now, *at));
                let copy = Landing { at: at.unwrap_or(now), dev, sub, moved, r };
                if at.is_none() {
                    // The booking has ended (or there is none): complete it now.
                    copy.finish();
                } else if let Err(copy) = ch.land(copy) {
                    // No room in the landing list: wait here instead.
                    if let Some(b) = plan.booking {
                        copy.dev.links.wait(b);
                    }
                    copy.finish();
                }
            }
        }
    }
}

impl Channel {
    fn new(wq: &Wq) -> Result<Arc<Channel>> {
        // INVARIANT: the module's queue (the only `Wq`); the timer starts unarmed.
        Arc::pin_init(
            pin_init!(Channel {
                wq: wq.raw(),
                queue <- new_mutex!(Pending::default(), "gmem_sim::Channel::queue"),
                work <- new_work!("gmem_sim::Channel::work"),
                landed <- new_spinlock_irq!(Landed::default(), "gmem_sim::Channel::landed"),
                timer <- HrTimer::new(),
            }),
            GFP_KERNEL,
        )
    }

    /// Arms the timer for `at` (the caller holds `landed` and records `at` in it).
    fn arm(&self, at: Instant<Monotonic>) {
        // SAFETY: `self` is a live channel (pinned in its `Arc`), which cancels the timer
        // before it is freed (type invariant): it outlives the timer's expiry or
        // cancellation.
        unsafe { <Self as HasHrTimer<Self>>::start(self, at) };
    }

    /// Puts `copy` in the landing list, in order of its link time's end, and arms the timer
    /// if the copy ends before what it is armed for; gives the copy back if the list has
    /// no room (interrupts are off here: no sleeping allocation).
    fn land(&self, copy: Landing) -> core::result::Result<(), Landing> {
        let mut l = self.landed.lock();
        if l.copies.reserve(1, GFP_ATOMIC).is_err() {
            return Err(copy);
        }
        let at = copy.at;
        let k = l.copies.iter().position(|c| before(at, c.at)).unwrap_or(l.copies.len());
        // Room reserved above, and `k <= len`.
        if let Err(e) = l.copies.insert_within_capacity(k, copy) {
            return Err(match e {
                kernel::alloc::kvec::InsertError::IndexOutOfBounds(c)
                | kernel::alloc::kvec::InsertError::OutOfCapacity(c) => c,
            });
        }
        if l.armed.is_none_or(|a| before(at, a)) {
            l.armed = Some(at);
            self.arm(at);
        }
        Ok(())
    }
}

impl Landed {
    /// The earliest landing copy, taken out of the list, if its link time has ended; else
    /// when the next one ends (`None`: none is landing).
    fn take_due(&mut self) -> core::result::Result<Landing, Option<Instant<Monotonic>>> {
        match self.copies.first().map(|c| c.at) {
            // (`remove(0)` cannot fail: the list has a first copy.)
            Some(at) if !before(Instant::now(), at) => self.copies.remove(0).map_err(|_| None),
            next => Err(next),
        }
    }
}

impl Channel {
    /// Completes the landing copies whose link time has ended, earliest first (counted in
    /// `polled`); the timer stays armed for what it was (it then finds the next copy, or
    /// none).
    fn complete_due(&self) {
        loop {
            // The guard is a temporary of the `let`, dropped at its end (a `while let`
            // would keep it for the body): the copy is signalled without the lock, as the
            // timer does.
            let Ok(copy) = self.landed.lock().take_due() else { return };
            copy.dev.chan.polled.fetch_add(1, Ordering::Relaxed);
            copy.finish();
        }
    }
}

impl HrTimerCallback for Channel {
    type Pointer<'a> = Pin<&'a Channel>;

    /// The engine's completion interrupt: completes every landing copy whose link time has
    /// ended, then re-arms for the next one, if any.
    fn run(this: Pin<&Channel>, _ctx: HrTimerCallbackContext<'_, Self>) -> HrTimerRestart {
        loop {
            let mut l = this.landed.lock();
            match l.take_due() {
                Ok(copy) => {
                    drop(l);
                    // Signalled without the lock (the waiter may start another copy).
                    copy.finish();
                }
                Err(next) => {
                    // Re-armed from here (a timer may be started from its own callback;
                    // the hrtimer core then leaves it queued), or left unarmed.
                    l.armed = next;
                    if let Some(at) = next {
                        this.arm(at);
                    }
                    return HrTimerRestart::NoRestart;
                }
            }
        }
    }
}

#[pinned_drop]
impl PinnedDrop for Channel {
    fn drop(self: Pin<&mut Self>) {
        // SAFETY: the channel's own, initialised timer; `hrtimer_cancel` returns once it is
        // neither queued nor running its callback, after which nothing arms it again (the
        // channel is being dropped: no worker or callback can reach it any more).
        unsafe { bindings::hrtimer_cancel(<Self as HasHrTimer<Self>>::c_timer_ptr(&*self).cast_mut()) };
        // Copies still landing (none: gmem waits for every fence before a device goes)
        // would be signalled failed by their submissions' drop.
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
    /// Copies completed by gmem's polling (`copy_poll`) rather than by a channel's timer
    /// or worker.
    pub(crate) polled: AtomicU64,
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

    /// Completes now every copy of channel `chan` whose data has landed and whose link time
    /// has ended (`copy_poll`): what the channel's timer would do when it fires.
    pub(crate) fn poll(&self, chan: u32) {
        if let Some(ch) = self.chans.get(chan as usize) {
            ch.complete_due();
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
            // Its booking's end is when gmem may start polling for it (`poll`).
            if let Some(at) = dev.landing_at(&plan) {
                sub.expect_in(at - Instant::now());
            }
            let _ = q.copies.push_within_capacity((dev.clone(), sub, plan));
        }
        // SAFETY: the module's queue, alive while any channel is used (type invariant).
        let wq = unsafe { Queue::from_raw(ch.wq) };
        // Already queued (and not yet running): that run finds this copy.
        let _ = wq.enqueue(ch.clone());
    }
}
