// SPDX-License-Identifier: GPL-2.0
//! `/dev/gmem`: the user API. Every ioctl of `include/uapi/linux/gmem.h` enters here, is
//! validated (size field, reserved fields, flags) and handed to the mechanism it names.

use crate::registry;
use kernel::{
    fs::File,
    ioctl::_IOWR,
    miscdevice::{MiscDevice, MiscDeviceRegistration},
    prelude::*,
    uaccess::{UserPtr, UserSlice},
};

pub(crate) const UAPI_VERSION: u32 = 1;
const MAGIC: u32 = b'G' as u32;

/// `struct gmem_version`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Version {
    argsz: u32,
    version: u32,
    nr_devices: u32,
    reserved: u32,
}

// SAFETY: plain-old-data made of integers; every bit pattern is valid.
unsafe impl kernel::transmute::FromBytes for Version {}
// SAFETY: plain-old-data made of integers, no padding.
unsafe impl kernel::transmute::AsBytes for Version {}

const IOC_VERSION: u32 = _IOWR::<Version>(MAGIC, 0x00);

/// One open of `/dev/gmem`.
pub(crate) struct GmemFile;

#[vtable]
impl MiscDevice for GmemFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(_file: &File, _misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        KBox::pin(GmemFile, GFP_KERNEL).map_err(Into::into)
    }

    fn ioctl(_me: Pin<&GmemFile>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        match cmd {
            IOC_VERSION => {
                let (mut r, mut w) = UserSlice::new(UserPtr::from_addr(arg), core::mem::size_of::<Version>()).reader_writer();
                let mut v: Version = r.read()?;
                if v.argsz as usize != core::mem::size_of::<Version>() || v.reserved != 0 {
                    return Err(EINVAL);
                }
                v.version = UAPI_VERSION;
                v.nr_devices = registry::count() as u32;
                w.write(&v)?;
                Ok(0)
            }
            _ => Err(ENOTTY),
        }
    }
}
