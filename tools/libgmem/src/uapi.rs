// SPDX-License-Identifier: GPL-2.0
//! Mirror of `include/uapi/linux/gmem.h` (the header is the reference; tests in
//! `tools/gmem-tests` check the sizes the kernel accepts).

pub const GMEM_UAPI_VERSION: u32 = 1;
pub const GMEM_PAGE_SIZE: u64 = 4096;
pub const GMEM_MAX_ALLOC: u64 = 1 << 40;
pub const GMEM_NO_DEVICE: i32 = -1;
pub const GMEM_HOST: i32 = -2;

pub const GMEM_ADV_PREFETCH: u32 = 1;
pub const GMEM_ADV_PREFERRED_LOC: u32 = 2;
pub const GMEM_ADV_UNSET_PREFERRED_LOC: u32 = 3;
pub const GMEM_ADV_ACCESSED_BY: u32 = 4;
pub const GMEM_ADV_UNSET_ACCESSED_BY: u32 = 5;
pub const GMEM_ADV_READ_MOSTLY: u32 = 6;
pub const GMEM_ADV_UNSET_READ_MOSTLY: u32 = 7;
pub const GMEM_ADV_PIN: u32 = 8;
pub const GMEM_ADV_UNPIN: u32 = 9;
pub const GMEM_ADV_DONTNEED: u32 = 10;
pub const GMEM_ADVF_ASYNC: u32 = 1;

pub const GMEM_LOC_NONE: u32 = 0;
pub const GMEM_LOC_HOST: u32 = 1;
pub const GMEM_LOC_DEVICE: u32 = 2;
/// The data could not be saved when its device went away: accesses fail until DONTNEED.
pub const GMEM_LOC_LOST: u32 = 3;
pub const GMEM_Q_PINNED: u32 = 1 << 16;
pub const GMEM_Q_DIRTY: u32 = 1 << 17;
pub const GMEM_Q_DUP: u32 = 1 << 18;
pub const GMEM_Q_REMOTE: u32 = 1 << 19;
pub const GMEM_Q_CPU_MAPPED: u32 = 1 << 20;
pub const GMEM_QUERY_MAX: u64 = 1 << 20;

pub fn q_loc(w: u32) -> u32 {
    w & 0xff
}
pub fn q_dev(w: u32) -> u32 {
    (w >> 8) & 0xff
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemVersion {
    pub argsz: u32,
    pub version: u32,
    pub nr_devices: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemAlloc {
    pub argsz: u32,
    pub flags: u32,
    pub size: u64,
    pub preferred_dev: i32,
    pub reserved0: u32,
    pub addr: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemFree {
    pub argsz: u32,
    pub flags: u32,
    pub addr: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemAdvise {
    pub argsz: u32,
    pub advice: u32,
    pub addr: u64,
    pub len: u64,
    pub dev: i32,
    pub flags: u32,
    pub fence: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemWait {
    pub argsz: u32,
    pub flags: u32,
    pub fence: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GmemQuery {
    pub argsz: u32,
    pub flags: u32,
    pub addr: u64,
    pub npages: u64,
    pub states: u64,
    pub dup_mask: u64,
    pub reserved: [u64; 2],
}

// _IOWR('G', nr, T) = (3 << 30) | (size << 16) | ('G' << 8) | nr
const fn iowr(nr: u64, size: usize) -> u64 {
    (3u64 << 30) | ((size as u64) << 16) | ((b'G' as u64) << 8) | nr
}

pub const GMEM_IOC_VERSION: u64 = iowr(0x00, std::mem::size_of::<GmemVersion>());
pub const GMEM_IOC_ALLOC: u64 = iowr(0x01, std::mem::size_of::<GmemAlloc>());
pub const GMEM_IOC_FREE: u64 = iowr(0x02, std::mem::size_of::<GmemFree>());
pub const GMEM_IOC_ADVISE: u64 = iowr(0x03, std::mem::size_of::<GmemAdvise>());
pub const GMEM_IOC_WAIT: u64 = iowr(0x04, std::mem::size_of::<GmemWait>());
pub const GMEM_IOC_QUERY: u64 = iowr(0x05, std::mem::size_of::<GmemQuery>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_the_c_header() {
        // Values computed from include/uapi/linux/gmem.h for x86_64.
        assert_eq!(std::mem::size_of::<GmemVersion>(), 16);
        assert_eq!(std::mem::size_of::<GmemAlloc>(), 48);
        assert_eq!(std::mem::size_of::<GmemFree>(), 32);
        assert_eq!(std::mem::size_of::<GmemAdvise>(), 56);
        assert_eq!(std::mem::size_of::<GmemWait>(), 32);
        assert_eq!(std::mem::size_of::<GmemQuery>(), 56);
    }

    #[test]
    fn ioctl_numbers_encode_size_and_magic() {
        assert_eq!(GMEM_IOC_VERSION, 0xC010_4700);
        assert_eq!(GMEM_IOC_ALLOC & 0xffff, 0x4701);
        assert_eq!((GMEM_IOC_QUERY >> 16) & 0x3fff, 56);
    }
}
