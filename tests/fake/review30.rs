//! Review 30 (the thirty-sixth session's reviews of streams, contexts and memory types): peer
//! access undone with its contexts.

use cudrv::Device;
use cudrv::sys::CUresult;
use cudrv_test_support::run_with_fake;

/// Peer access lasts after `enable_peer_access` returns with nothing else holding the two
/// devices' contexts (destroying them undid it).
#[test]
fn peer_access_lasts_when_nothing_else_holds_the_contexts() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        d0.enable_peer_access(&d1).unwrap();
        let (c0, c1) = (d0.primary_context().unwrap(), d1.primary_context().unwrap());
        let _b = c0.bind().unwrap();
        let d = cudrv::sys::Driver::global().unwrap();
        // SAFETY: c0 is current, c1 a retained primary context, flags 0.
        let rc = unsafe { d.cuCtxEnablePeerAccess(c1.as_raw(), 0) }.unwrap();
        assert_eq!(rc, CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "the peer access went with the contexts");
    });
}
