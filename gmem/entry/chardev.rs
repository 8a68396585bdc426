// SPDX-License-Identifier: GPL-2.0
//! `/dev/gmem`: the user API. Every ioctl of `include/uapi/linux/gmem.h` enters here, is
//! validated (size field, reserved fields, flags, ranges) and handed to the mechanism it
//! names. Also the mmap contract: a region is one shared mapping of this file at offset 0;
//! `GMEM_IOC_ALLOC` makes it with `vm_mmap()` on the caller's behalf.
//!
//! One open file = one handle on the calling process's address space (`space.rs`). Lock
//! order: `alloc_lock` -> mmap lock -> `pending`; `fences` -> `Space::serial` (a leaf).

use crate::entry::advise::{self, Advice, Fence};
use crate::entry::vm_ops;
use crate::mech::sysmem;
use crate::obj::device::Device;
use crate::obj::devices;
use crate::obj::region::{adv, Region, PAGE_SIZE};
use crate::obj::space::{self, Space};
use crate::policy::{page_state::PageState, range};
use core::sync::atomic::{fence, Ordering};
use kernel::{
    bindings,
    error::to_result,
    fs::File,
    ioctl::_IOWR,
    miscdevice::{MiscDevice, MiscDeviceRegistration},
    mm::virt::{flags as vmflags, VmaNew},
    new_mutex, new_spinlock,
    prelude::*,
    sync::{Arc, Mutex, SpinLock},
    transmute::{AsBytes, FromBytes},
    uaccess::{UserPtr, UserSlice, UserSliceWriter},
};

pub(crate) const UAPI_VERSION: u32 = 1;
const MAGIC: u32 = b'G' as u32;
/// Largest allocation (1 TiB), `GMEM_MAX_ALLOC`.
pub(crate) const MAX_ALLOC: u64 = 1 << 40;
const QUERY_MAX: u64 = 1 << 20;
/// Outstanding ASYNC fences per open file.
const MAX_FENCES: usize = 256;
// Values of the generic mman uapi (not in the Rust bindings).
const PROT_READ: usize = 1;
const PROT_WRITE: usize = 2;
const MAP_SHARED: usize = 1;

/// The ioctl argument structs of the uapi header; each starts with its own size.
macro_rules! uapi_struct {
    ($(#[$m:meta])* $name:ident { $($f:ident : $t:ty),* $(,)? } reserved: [$($r:ident),*]) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct $name { $($f: $t),* }
        // SAFETY: integers only, laid out without padding (checked by the uapi tests).
        unsafe impl FromBytes for $name {}
        // SAFETY: as above.
        unsafe impl AsBytes for $name {}
        impl UapiArg for $name {
            fn argsz(&self) -> u32 { self.argsz }
            fn reserved_zero(&self) -> bool { true $(&& is_zero(&self.$r))* }
        }
    };
}

fn is_zero<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

trait UapiArg: FromBytes + AsBytes + Copy {
    fn argsz(&self) -> u32;
    fn reserved_zero(&self) -> bool;
}

uapi_struct!(
    /// `struct gmem_version`
    Version { argsz: u32, version: u32, nr_devices: u32, reserved: u32 } reserved: [reserved]
);
uapi_struct!(
    /// `struct gmem_alloc`
    AllocArg { argsz: u32, flags: u32, size: u64, preferred_dev: i32, reserved0: u32, addr: u64,
               reserved: [u64; 2] } reserved: [reserved0, reserved]
);
uapi_struct!(
    /// `struct gmem_free`
    FreeArg { argsz: u32, flags: u32, addr: u64, reserved: [u64; 2] } reserved: [reserved]
);
uapi_struct!(
    /// `struct gmem_advise`
    AdviseArg { argsz: u32, advice: u32, addr: u64, len: u64, dev: i32, flags: u32, fence: u64,
                reserved: [u64; 2] } reserved: [reserved]
);
uapi_struct!(
    /// `struct gmem_wait`
    WaitArg { argsz: u32, flags: u32, fence: u64, reserved: [u64; 2] } reserved: [reserved]
);
uapi_struct!(
    /// `struct gmem_query`
    QueryArg { argsz: u32, flags: u32, addr: u64, npages: u64, states: u64, dup_mask: u64,
               reserved: [u64; 2] } reserved: [reserved]
);

const IOC_VERSION: u32 = _IOWR::<Version>(MAGIC, 0x00);
const IOC_ALLOC: u32 = _IOWR::<AllocArg>(MAGIC, 0x01);
const IOC_FREE: u32 = _IOWR::<FreeArg>(MAGIC, 0x02);
const IOC_ADVISE: u32 = _IOWR::<AdviseArg>(MAGIC, 0x03);
const IOC_WAIT: u32 = _IOWR::<WaitArg>(MAGIC, 0x04);
const IOC_QUERY: u32 = _IOWR::<QueryArg>(MAGIC, 0x05);

/// Reads an argument struct and checks its size field and reserved fields.
fn read_arg<T: UapiArg>(arg: usize) -> Result<(T, UserSliceWriter)> {
    let (mut r, w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<T>()).reader_writer();
    let v: T = r.read()?;
    if v.argsz() as usize != core::mem::size_of::<T>() || !v.reserved_zero() {
        return Err(EINVAL);
    }
    Ok((v, w))
}

/// Parameters an ALLOC hands to the mmap it triggers.
struct Pending {
    size: usize,
    advice: u32,
    /// The device `advice` prefers, as ALLOC found it alive: the very object, not its id,
    /// which a device registered later may take (`forget_dead_preference`).
    preferred: Option<Arc<Device>>,
}

struct Fences {
    list: KVec<Arc<Fence>>,
    next: u64,
}

/// One open of `/dev/gmem`.
#[pin_data(PinnedDrop)]
pub(crate) struct GmemFile {
    space: Arc<Space>,
    #[pin]
    alloc_lock: Mutex<()>,
    #[pin]
    pending: SpinLock<Option<Pending>>,
    #[pin]
    fences: Mutex<Fences>,
}

#[pinned_drop]
impl PinnedDrop for GmemFile {
    fn drop(self: Pin<&mut Self>) {
        // Nothing may outlive the file: stop every outstanding asynchronous prefetch (nobody
        // can wait for it any more). Those not started are taken off the space's queue
        // and never run (so this does not wait behind fences of the process's other
        // files); a running one stops at its next chunk, and is waited for.
        let list = core::mem::take(&mut self.fences.lock().list);
        for f in list.iter() {
            f.cancel();
        }
        for f in list.iter() {
            let _ = f.wait();
        }
        space::release(&self.space);
    }
}

impl GmemFile {
    fn version(&self, arg: usize) -> Result {
        let (mut v, mut w) = read_arg::<Version>(arg)?;
        v.version = UAPI_VERSION;
        v.nr_devices = devices::count() as u32;
        w.write(&v)
    }

    fn alloc(&self, file: &File, arg: usize) -> Result {
        let (mut a, mut w) = read_arg::<AllocArg>(arg)?;
        if a.flags != 0 {
            return Err(EINVAL);
        }
        let size = match range::alloc_size(a.size, MAX_ALLOC) {
            Ok(_) => a.size,
            Err(range::RangeError::Overflow) => return Err(E2BIG),
            Err(_) => return Err(EINVAL),
        };
        let (advice, preferred) = match a.preferred_dev {
            advise::NO_DEVICE => (0, None),
            advise::HOST => (adv::PREF_HOST << adv::PREF_SHIFT, None),
            d => {
                let id = usize::try_from(d).map_err(|_| EINVAL)?;
                let dev = devices::get(id).filter(|d| d.alive()).ok_or(ENODEV)?;
                ((id as u32 + 1) << adv::PREF_SHIFT, Some(dev))
            }
        };
        let _serialise = self.alloc_lock.lock();
        *self.pending.lock() = Some(Pending { size: size as usize, advice, preferred });
        // SAFETY: `file` is this open file; we are in process context without the mmap lock.
        let addr = unsafe { bindings::vm_mmap(file.as_ptr(), 0, size as usize, PROT_READ | PROT_WRITE, MAP_SHARED, 0) };
        // Taken out under the lock, dropped after it (it may hold the last reference to an
        // unregistered device).
        let unused = self.pending.lock().take();
        drop(unused);
        if addr >= (-4095isize) as usize {
            return Err(Error::from_errno(addr as isize as i32));
        }
        a.addr = addr as u64;
        if let Err(e) = w.write(&a) {
            // SAFETY: unmapping the range we just mapped, in the caller's own mm.
            unsafe { bindings::vm_munmap(addr, size as usize) };
            return Err(e);
        }
        Ok(())
    }

    fn free(&self, arg: usize) -> Result {
        let (f, _) = read_arg::<FreeArg>(arg)?;
        if f.flags != 0 {
            return Err(EINVAL);
        }
        let addr = usize::try_from(f.addr).map_err(|_| EINVAL)?;
        let region = self.space.region_at(addr).ok_or(ENOENT)?;
        if region.start != addr {
            return Err(EINVAL);
        }
        let len = region.len();
        drop(region);
        // SAFETY: process context, caller's own mm, no locks held; munmap closes the VMA,
        // which tears the region down.
        to_result(unsafe { bindings::vm_munmap(addr, len) })
    }

    fn advise(&self, arg: usize) -> Result {
        let (mut a, mut w) = read_arg::<AdviseArg>(arg)?;
        let advice = Advice { advice: a.advice, addr: a.addr, len: a.len, dev: a.dev };
        advise::validate(&advice, a.flags)?;
        a.fence = 0;
        if a.flags & advise::FLAG_ASYNC != 0 {
            // Bad ranges fail here, synchronously; only the data movement is deferred.
            advise::check_range(&self.space, &advice)?;
            a.fence = {
                let mut fences = self.fences.lock();
                if fences.list.len() >= MAX_FENCES {
                    return Err(EBUSY);
                }
                fences.list.reserve(1, GFP_KERNEL)?;
                let id = fences.next;
                let f = Fence::start(id, self.space.clone(), advice)?;
                fences.next += 1;
                fences.list.push(f, GFP_KERNEL)?;
                id
            };
            // With no lock held (the struct may lie in a GMEM region and fault).
            let written = w.write(&a);
            if written.is_err() {
                // Nobody learnt the fence's id: it is stopped and forgotten, as at close,
                // and frees its place under the limit.
                if let Some(f) = self.take_fence(a.fence) {
                    f.cancel();
                    let _ = f.wait();
                }
            }
            written
        } else {
            // Written back before the advice runs: the argument struct may lie in the very
            // range being pinned or moved, and must not be reached through it afterwards.
            w.write(&a)?;
            advise::advise(&self.space, &advice)
        }
    }

    fn wait(&self, arg: usize) -> Result {
        let (wt, _) = read_arg::<WaitArg>(arg)?;
        if wt.flags != 0 {
            return Err(EINVAL);
        }
        self.take_fence(wt.fence).ok_or(ENOENT)?.wait_killable()
    }

    /// Takes the outstanding fence `id` off this file's list (it no longer counts towards
    /// the limit); `None` if there is none.
    fn take_fence(&self, id: u64) -> Option<Arc<Fence>> {
        let mut fences = self.fences.lock();
        let i = fences.list.iter().position(|f| f.id == id)?;
        fences.list.remove(i).ok()
    }

    fn query(&self, arg: usize) -> Result {
        let (mut q, mut w) = read_arg::<QueryArg>(arg)?;
        if q.flags != 0 || q.npages == 0 {
            return Err(EINVAL);
        }
        if q.npages > QUERY_MAX {
            return Err(E2BIG);
        }
        let addr = usize::try_from(q.addr).map_err(|_| EINVAL)?;
        let Some(region) = self.space.region_at(addr) else {
            // Ordinary process memory (mech/sysmem.rs): no duplicates there.
            let out = sysmem::query(&self.space, q.addr & !0xfff, q.npages as usize)?;
            write_states(q.states, &out)?;
            q.dup_mask = 0;
            return w.write(&q);
        };
        let first = region.index(addr).ok_or(ENOENT)?;
        let n = q.npages as usize;
        if first + n > region.npages {
            return Err(EINVAL);
        }
        let mut out = KVVec::with_capacity(n, GFP_KERNEL)?;
        // Set from the first page's block below if that exists; an untouched one has none.
        q.dup_mask = 0;
        // Block by block; untouched blocks are never touched pages (and stay unallocated).
        let mut i = first;
        while i < first + n {
            let end = core::cmp::min(first + n, region.block_pages(i).end);
            match region.block_if_any(i) {
                Some(block) => {
                    let p = region.lock(&block);
                    for j in i..end {
                        out.push(p.state(j).query_word(), GFP_KERNEL)?;
                    }
                    if i == first {
                        q.dup_mask = u64::from(p.state(first).dup_mask());
                    }
                }
                None => {
                    for _ in i..end {
                        out.push(PageState::EMPTY.query_word(), GFP_KERNEL)?;
                    }
                }
            }
            i = end;
        }
        write_states(q.states, &out)?;
        w.write(&q)
    }
}

/// Copies QUERY's state words out to the user array at `states`.
fn write_states(states: u64, out: &[u32]) -> Result {
    let bytes = out.len().checked_mul(4).ok_or(EINVAL)?;
    UserSlice::new(UserPtr::from_addr(states as usize), bytes).writer().write_slice(AsBytes::as_bytes(out))
}

/// ALLOC's preferred device `dev` (the new region's PREFERRED_LOC) may have started
/// unregistering since ALLOC checked it, and its evacuation, which forgets the advice
/// naming it, may have walked the space before the region was in it: the preference is
/// forgotten here then, so that a device registered later under the same id does not
/// inherit it. `dev` is the object ALLOC checked, not a lookup of its id now: a new
/// device may have taken the id meanwhile. Called after the region is in the space's tree
/// (the fence pairs with the one in `evacuate::evacuation_pass`: either that pass finds
/// the region, or this sees the device dead).
fn forget_dead_preference(region: &Region, dev: Option<&Device>) {
    fence(Ordering::SeqCst);
    if let Some(dev) = dev.filter(|d| !d.alive()) {
        adv::forget_device(&mut region.advice.lock(), dev.id);
    }
}

#[vtable]
impl MiscDevice for GmemFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(_file: &File, _misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        let task = kernel::current!();
        let mm = task.mm().ok_or(EINVAL)?;
        let space = space::open(mm)?;
        let for_file = space.clone();
        let r = KBox::try_pin_init(
            try_pin_init!(GmemFile {
                space: for_file,
                alloc_lock <- new_mutex!((), "gmem_file_alloc"),
                pending <- new_spinlock!(None, "gmem_file_pending"),
                fences <- new_mutex!(Fences { list: KVec::new(), next: 1 }, "gmem_file_fences"),
            }),
            GFP_KERNEL,
        );
        if r.is_err() {
            space::release(&space);
        }
        r
    }

    fn mmap(me: Pin<&GmemFile>, _file: &File, vma: &VmaNew) -> Result {
        if !core::ptr::eq(vma.mm().as_raw(), me.space.mm().as_raw()) {
            return Err(EINVAL);
        }
        // SAFETY: the VMA is being set up by mmap under the mmap write lock.
        let pgoff = unsafe { (*vma.as_ptr()).vm_pgoff };
        // A read-only shared mapping of an O_RDONLY fd has VM_MAYSHARE without VM_SHARED.
        if pgoff != 0 || vma.flags() & (vmflags::SHARED | vmflags::MAYSHARE) == 0 {
            return Err(EINVAL);
        }
        let len = vma.end() - vma.start();
        if len == 0 || len % PAGE_SIZE != 0 || len as u64 > MAX_ALLOC {
            return Err(EINVAL);
        }
        let pending = me.pending.lock().take().filter(|p| p.size == len);
        let advice = pending.as_ref().map_or(0, |p| p.advice);
        let region = Region::new(me.space.clone(), vma.start(), len / PAGE_SIZE, advice)?;
        me.space.insert_region(region.clone())?;
        forget_dead_preference(&region, pending.as_ref().and_then(|p| p.preferred.as_deref()));
        vma.set_mixedmap();
        // No GUP on GMEM memory (see access.rs): a pinned host page would be decoupled from
        // the data as soon as the page migrates. ptrace and /proc/PID/mem use `.access`.
        vma.set_io();
        vma.set_dontexpand();
        vma.set_dontcopy();
        vma.set_dontdump();
        // SAFETY: the VMA is ours and under construction.
        unsafe { vm_ops::attach(vma.as_ptr(), region) };
        Ok(())
    }

    fn ioctl(me: Pin<&GmemFile>, file: &File, cmd: u32, arg: usize) -> Result<isize> {
        if cmd != IOC_VERSION && !me.space.is_current() {
            // The fd was passed to or inherited by another process.
            return Err(EPERM);
        }
        match cmd {
            IOC_VERSION => me.version(arg),
            IOC_ALLOC => me.alloc(file, arg),
            IOC_FREE => me.free(arg),
            IOC_ADVISE => me.advise(arg),
            IOC_WAIT => me.wait(arg),
            IOC_QUERY => me.query(arg),
            _ => Err(ENOTTY),
        }
        .map(|()| 0)
    }
}

#[kunit_tests(gmem_chardev)]
mod tests {
    use super::*;
    use crate::obj::devices::tests::test_driver;
    use crate::obj::space::tests::test_space;
    use crate::policy::page_state::Target;

    #[test]
    fn a_preference_for_a_device_gone_since_alloc_is_forgotten_though_its_id_is_taken() {
        // ALLOC found device `old` alive; before its mmap made the region, `old`
        // unregistered and `new` took its id.
        let old = devices::insert(test_driver(), 1).expect("insert old");
        let d = old.id;
        old.kill();
        drop(devices::remove(d));
        let new = devices::insert(test_driver(), 1).expect("insert new");
        // Ids are reused lowest first.
        assert_eq!(new.id, d);
        let s = test_space();
        let r = Region::new(s.clone(), 0x40_0000, 4, (d as u32 + 1) << adv::PREF_SHIFT).expect("region");
        // A preference checked against a device still alive stays.
        forget_dead_preference(&r, Some(&new));
        assert_eq!(adv::preferred(r.advice.lock().get(3)), Some(Target::Device(d as u8)));
        // One checked against the device ALLOC saw goes, though a live device has its id
        // (a lookup of the id would have found `new` and kept it).
        forget_dead_preference(&r, Some(&old));
        assert_eq!(adv::preferred(r.advice.lock().get(0)), None);
        assert_eq!(adv::preferred(r.advice.lock().get(3)), None);
        new.kill();
        drop(devices::remove(d));
        drop(r);
        space::release(&s);
    }
}
