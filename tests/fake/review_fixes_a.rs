//! Regression tests for three review findings in managed and pitched memory: an over-aligned
//! element type made `ManagedBuffer` hand out misaligned slices; a host row stride whose bytes
//! overflow (accepted with one row) panicked or wrapped in the strided copies; and zero-sized
//! elements (or no rows) left the element count of a pitched buffer unchecked, so `len()`
//! overflowed. Each body runs in a child process with the fake driver.

use cudrv::memory::{DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, DeviceRepr, ManagedBuffer};
use cudrv::{Device, Stream};
use cudrv_test_support::{fake_report, run_with_fake, run_with_fake_modes};

use crate::{assert_no_leaks_but_streams, invalid_argument};

/// Aligned to 8192 bytes: more than the 256 bytes that allocations guarantee.
#[repr(C, align(8192))]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Over8192([u8; 8192]);
// SAFETY: repr(C), one byte array filling the whole size (no padding); any bits are valid.
unsafe impl DeviceRepr for Over8192 {}

/// Aligned to 512 bytes: the smallest alignment over the limit.
#[repr(C, align(512))]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Over512([u8; 512]);
// SAFETY: as Over8192.
unsafe impl DeviceRepr for Over512 {}

/// Aligned to exactly 256 bytes: the most that is allowed.
#[repr(C, align(256))]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Aligned256([u32; 64]);
// SAFETY: repr(C), 64 u32s filling the whole 256 bytes (no padding); any bits are valid.
unsafe impl DeviceRepr for Aligned256 {}

/// Checks that `msg` is the refusal of an element type aligned to `align` bytes, for `what`.
#[track_caller]
fn assert_alignment_refusal(msg: &str, what: &str, align: usize) {
    assert!(msg.starts_with(what), "{msg}");
    assert!(msg.contains("align_of::<T>() <= 256"), "{msg}");
    assert!(msg.ends_with(&format!("has {align}")), "{msg}");
}

#[test]
fn managed_buffer_refuses_element_types_aligned_over_256_bytes() {
    run_with_fake_modes(&["linux", "wddm"], &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // SAFETY: refused before anything is allocated.
        let msg = invalid_argument(unsafe { ManagedBuffer::<Over8192>::uninit(4, &s) }.unwrap_err());
        assert_alignment_refusal(&msg, "ManagedBuffer", 8192);
        assert!(msg.contains("Over8192"), "{msg}");
        let msg = invalid_argument(ManagedBuffer::<Over8192>::zeroed(1, &s).unwrap_err());
        assert_alignment_refusal(&msg, "ManagedBuffer", 8192);
        let msg = invalid_argument(ManagedBuffer::from_slice(&[Over8192([7; 8192]); 2], &s).unwrap_err());
        assert_alignment_refusal(&msg, "ManagedBuffer", 8192);
        // Empty buffers too: the type is wrong whatever the length.
        let msg = invalid_argument(ManagedBuffer::<Over8192>::zeroed(0, &s).unwrap_err());
        assert_alignment_refusal(&msg, "ManagedBuffer", 8192);
        let msg = invalid_argument(ManagedBuffer::from_slice(&[Over512([1; 512]); 3], &s).unwrap_err());
        assert_alignment_refusal(&msg, "ManagedBuffer", 512);
        // The same rule, and the same error, as DeviceBuffer's.
        let msg = invalid_argument(DeviceBuffer::<Over8192>::zeroed(4, &s).unwrap_err());
        assert_alignment_refusal(&msg, "DeviceBuffer", 8192);
        let msg = invalid_argument(DeviceBuffer::<Over512>::zeroed(4, &s).unwrap_err());
        assert_alignment_refusal(&msg, "DeviceBuffer", 512);
        // Nothing was allocated for the refused buffers.
        s.synchronize().unwrap();
        assert_no_leaks_but_streams();
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn managed_buffer_of_256_aligned_elements_round_trips() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "linux")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let data: Vec<Aligned256> =
            (0..5u32).map(|i| Aligned256(std::array::from_fn(|j| i * 1000 + j as u32))).collect();
        let mut m = ManagedBuffer::from_slice(&data, &s).unwrap();
        assert_eq!((m.len(), m.byte_len()), (5, 5 * 256));
        assert_eq!(m.as_raw() % 256, 0);
        {
            let host = m.as_slice().unwrap();
            assert_eq!(host.as_ptr() as usize % 256, 0, "the host slice is aligned for Aligned256");
            assert_eq!(host, &data[..]);
        }
        assert_eq!(m.to_vec().unwrap(), data);
        // Written on the host, read back through the driver; written through the driver, read on
        // the host.
        m.as_mut_slice().unwrap()[3].0[63] = 0xDEAD_BEEF;
        let mut expect = data.clone();
        expect[3].0[63] = 0xDEAD_BEEF;
        assert_eq!(m.to_vec().unwrap(), expect);
        let other: Vec<Aligned256> = (0..5u32).map(|i| Aligned256([i + 7; 64])).collect();
        m.copy_from_host(&other).unwrap();
        assert_eq!(m.as_slice().unwrap(), &other[..]);
        m.memset(0).unwrap();
        assert_eq!(m.as_slice().unwrap(), &[Aligned256([0; 64]); 5][..]);
        // DeviceBuffer takes the same type.
        let d = DeviceBuffer::from_slice(&data, &s).unwrap();
        assert_eq!(d.to_vec().unwrap(), data);
        drop((m, d));
        s.synchronize().unwrap();
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn strided_host_copies_refuse_a_row_stride_whose_bytes_overflow() {
    run_with_fake_modes(&["linux", "tcc"], &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let data = [1u32, 2, 3, 4];
        let mut a = DeviceBuffer2D::from_slice(&data, 4, 1, &s).unwrap();
        // usize::MAX / 2 elements of 4 bytes overflow usize: refused, and `dst` is untouched.
        let huge = usize::MAX / 2;
        let mut dst = [0xAAAA_AAAAu32; 4];
        let msg = invalid_argument(a.copy_to_host_strided(&mut dst, huge).unwrap_err());
        assert!(msg.starts_with("DeviceView2D::copy_to_host_strided: a row stride of"), "{msg}");
        assert!(msg.contains(&format!("{huge} elements of 4 bytes overflows")), "{msg}");
        assert_eq!(dst, [0xAAAA_AAAA; 4], "nothing was written");
        let msg = invalid_argument(a.as_view().copy_to_host_strided(&mut dst, huge).unwrap_err());
        assert!(msg.contains("overflows"), "{msg}");
        let msg = invalid_argument(a.row(0).unwrap().copy_to_host_strided(&mut dst, usize::MAX).unwrap_err());
        assert!(msg.contains("overflows"), "{msg}");
        assert_eq!(dst, [0xAAAA_AAAA; 4], "nothing was written");
        // The other direction: refused, and the buffer keeps its data.
        let msg = invalid_argument(a.copy_from_host_strided(&[9; 4], huge).unwrap_err());
        assert!(msg.starts_with("DeviceBuffer2D::copy_from_host_strided: a row stride of"), "{msg}");
        assert!(msg.contains(&format!("{huge} elements of 4 bytes overflows")), "{msg}");
        assert_eq!(a.to_vec().unwrap(), data, "nothing was written");
        // A stride of more than isize::MAX bytes that does not wrap is refused too.
        let mut b = DeviceBuffer2D::from_slice(&[5u8, 6, 7], 3, 1, &s).unwrap();
        let mut dst8 = [0u8; 3];
        let over = isize::MAX as usize + 1;
        let msg = invalid_argument(b.copy_to_host_strided(&mut dst8, over).unwrap_err());
        assert!(msg.contains(&format!("{over} elements of 1 bytes overflows")), "{msg}");
        invalid_argument(b.copy_from_host_strided(&[0; 3], over).unwrap_err());
        assert_eq!((dst8, b.to_vec().unwrap()), ([0; 3], vec![5, 6, 7]));
        // A large stride that fits still copies the single row.
        a.copy_to_host_strided(&mut dst, 1 << 20).unwrap();
        assert_eq!(dst, data);
        a.copy_from_host_strided(&[4, 3, 2, 1], 1 << 20).unwrap();
        assert_eq!(a.to_vec().unwrap(), [4, 3, 2, 1]);
        // With two rows the slice bounds the stride (the check that existed already).
        let c = DeviceBuffer2D::<u32>::zeroed(4, 2, &s).unwrap();
        let mut two = [0u32; 8];
        let msg = invalid_argument(c.copy_to_host_strided(&mut two, huge).unwrap_err());
        assert!(msg.contains("the slice has 8"), "{msg}");
        drop((a, b, c));
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn pitched_buffers_check_their_element_count_for_zero_sized_elements() {
    run_with_fake_modes(&["linux", "wddm"], &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // Zero-sized elements: the count overflows, though the bytes (0) do not.
        let msg = invalid_argument(DeviceBuffer2D::<[u32; 0]>::zeroed(usize::MAX, 2, &s).unwrap_err());
        assert!(msg.contains("overflow"), "{msg}");
        // SAFETY: refused before anything is allocated.
        let msg = invalid_argument(unsafe { DeviceBuffer2D::<[u32; 0]>::uninit(2, usize::MAX, &s) }.unwrap_err());
        assert!(msg.contains("overflow"), "{msg}");
        let msg = invalid_argument(DeviceBuffer3D::<[u8; 0]>::zeroed((usize::MAX, 2, 1), &s).unwrap_err());
        assert!(msg.contains("overflow"), "{msg}");
        let msg = invalid_argument(DeviceBuffer3D::<[u8; 0]>::zeroed((usize::MAX, 1, 2), &s).unwrap_err());
        assert!(msg.contains("overflow"), "{msg}");
        // No slices: the rows (0) do not bound the width times the height either.
        let msg = invalid_argument(DeviceBuffer3D::<u8>::zeroed((usize::MAX, 2, 0), &s).unwrap_err());
        assert!(msg.contains("overflow"), "{msg}");
        // Counts that fit are accepted, as DeviceBuffer accepts zero-sized elements.
        let z = DeviceBuffer2D::<[u32; 0]>::zeroed(1000, 3, &s).unwrap();
        assert_eq!((z.len(), z.is_empty(), z.width(), z.height()), (3000, false, 1000, 3));
        assert_eq!(z.to_vec().unwrap().len(), 3000);
        assert_eq!(z.row(2).unwrap().to_vec().unwrap().len(), 1000);
        assert_eq!(z.view(10..20, 1..3).unwrap().len(), 20);
        let widest = DeviceBuffer2D::<[u32; 0]>::zeroed(usize::MAX, 1, &s).unwrap();
        assert_eq!(widest.len(), usize::MAX);
        let v = DeviceBuffer3D::<[u16; 0]>::zeroed((4, 5, 6), &s).unwrap();
        assert_eq!((v.len(), v.to_vec().unwrap().len()), (120, 120));
        assert_eq!(v.slice(5).unwrap().to_vec().unwrap().len(), 20);
        let empty = DeviceBuffer3D::<u8>::zeroed((usize::MAX, 1, 0), &s).unwrap();
        assert_eq!((empty.len(), empty.is_empty()), (0, true));
        // An empty box at the far corner of a tall volume: its row index would overflow.
        let tall = DeviceBuffer3D::<[u8; 0]>::zeroed((1, usize::MAX, 1), &s).unwrap();
        let mut tall2 = DeviceBuffer3D::<[u8; 0]>::zeroed((1, usize::MAX, 1), &s).unwrap();
        assert_eq!(tall.len(), usize::MAX);
        tall2.copy_box_from((1, usize::MAX, 1), &tall, (1, usize::MAX, 1), (0, 0, 0)).unwrap();
        tall2.copy_from(&tall).unwrap();
        drop((z, widest, v, empty, tall, tall2));
        s.synchronize().unwrap();
        assert_no_leaks_but_streams();
        assert!(fake_report().violations.is_empty());
    });
}
