//! The dispatcher's executor of async handlers: each call in progress is
//! a future in a slot, polled again when its waker queues the slot and
//! pokes the dispatcher.

use super::handler::{HandlerFuture, Scope};
use super::intake::To;
use crate::stream::{Inlet, Outlet};
use crate::transport::Waker;
use std::sync::{Arc, Mutex};

/// Async handlers' calls in progress, by slot.
#[derive(Default)]
pub(super) struct Tasks {
    pub(super) slots: Vec<Option<Task>>,
    /// Each slot's waker, made with the slot and kept for every call the
    /// slot holds (no allocation per call).
    pub(super) wakers: Vec<std::task::Waker>,
    pub(super) free: Vec<usize>,
    /// Slots whose futures were woken (filled by their wakers).
    pub(super) woken: Arc<Mutex<Vec<usize>>>,
    /// The list being polled (swapped with `woken`, to keep both buffers).
    pub(super) polling: Vec<usize>,
}

/// One async handler's call.
pub(super) struct Task {
    pub(super) to: To,
    /// The method's id (for a panic's message).
    pub(super) method: u32,
    pub(super) fut: HandlerFuture,
    /// What it is polled in.
    pub(super) scope: Scope,
    /// An async stream's items on their way out.
    pub(super) outlet: Option<Arc<Outlet>>,
    /// Its caller's items on their way in.
    pub(super) inlet: Option<Arc<Inlet>>,
}

/// The waker of slot `slot`'s call: queues the slot and pokes the
/// dispatcher. (A wake that arrives after its call ended and the slot was
/// reused polls the new call once more than needed, which futures allow.)
pub(super) struct TaskWake {
    pub(super) slot: usize,
    pub(super) woken: Arc<Mutex<Vec<usize>>>,
    pub(super) poke: Waker,
}

impl std::task::Wake for TaskWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        crate::sync::lock(&self.woken).push(self.slot);
        self.poke.wake();
    }
}
