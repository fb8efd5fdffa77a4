//! A memory resource slowed down, for tests that need another thread's allocation under way:
//! it holds the stream's gate meanwhile, as every allocation of a `DeviceBuffer` from a resource
//! other than cudrv's pool does. The tests wait until it has begun ([`under_way`]) instead of
//! betting on a head start.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudrv::memory::{DevicePtr, MemoryResource, ResourceKind};
use cudrv::{Device, Stream};

/// How long a [`Slowed`] resource's allocations wait, and where.
#[derive(Debug)]
enum Hold {
    /// A pause before the allocation.
    Before(Duration),
    /// After the allocation, until the test says so (or 30 s).
    AfterUntil(Mutex<Receiver<()>>),
}

/// `inner`, whose allocations take longer ([`Hold`]), and tell when they begin.
#[derive(Debug)]
pub(crate) struct Slowed {
    inner: Arc<dyn MemoryResource>,
    hold: Hold,
    /// Told when an allocation begins (inside `allocate`: under the stream's gate), or, held
    /// after, once it is made.
    began: Mutex<Sender<()>>,
}

/// `inner` slowed by `pause` an allocation, and what tells when one is under way.
pub(crate) fn slowed(inner: impl MemoryResource, pause: Duration) -> (Arc<Slowed>, Receiver<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Arc::new(Slowed { inner: Arc::new(inner), hold: Hold::Before(pause), began: Mutex::new(tx) }), rx)
}

/// `inner`, whose allocations, once made, wait until the test sends on the returned `Sender`
/// (at most 30 s); and what tells when one is made.
pub(crate) fn held_after(inner: Arc<dyn MemoryResource>) -> (Arc<Slowed>, Receiver<()>, Sender<()>) {
    let (made_tx, made) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let held = Slowed { inner, hold: Hold::AfterUntil(Mutex::new(go_rx)), began: Mutex::new(made_tx) };
    (Arc::new(held), made, go)
}

/// Waits until an allocation of a [`Slowed`] resource is under way (or, held after, made).
pub(crate) fn under_way(began: &Receiver<()>) {
    began.recv_timeout(Duration::from_secs(30)).expect("the allocation began");
}

// SAFETY: every pointer is `inner`'s, handed out and taken back as it came.
unsafe impl MemoryResource for Slowed {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        let tell = || {
            let _ = self.began.lock().unwrap().send(());
        };
        match &self.hold {
            Hold::Before(pause) => {
                tell();
                std::thread::sleep(*pause);
                self.inner.allocate(bytes, stream)
            }
            Hold::AfterUntil(go) => {
                let ptr = self.inner.allocate(bytes, stream);
                tell();
                let _ = go.lock().unwrap().recv_timeout(Duration::from_secs(30));
                ptr
            }
        }
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
    fn supports_capture(&self) -> bool {
        self.inner.supports_capture()
    }
}
