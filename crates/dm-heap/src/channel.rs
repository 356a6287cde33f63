//! Heaps of a connection and of a service (RPCool's channel heaps).
//!
//! A client's [`HeapChannel`] makes a heap of its own when it connects
//! and attaches it to its connection. The service reads the client's
//! arguments there in place, and may build its answers there for the
//! client to read in place. The heap is private to the connection:
//!
//! * the service takes an argument of a connection only in that
//!   connection's heap or in the service's shared heap, never in another
//!   client's;
//! * it lets go of the heap when the connection closes (its client
//!   dropped it or died): once the client has let go too, the pages are
//!   free.
//!
//! A service may have one heap shared by all its clients
//! ([`HeapService::with_shared`]). Each client opens it when it connects;
//! any of them may build values in it (the allocator takes several
//! processes at once), which outlive the call and the client.
//!
//! [`HeapService::serve`] adds two methods to the service:
//!
//! | method | request | answer |
//! |--------|---------|--------|
//! | `dm.heap/attach` | a heap's [`HeapRef`] (56 bytes) | empty: the heap is the connection's |
//! | `dm.heap/shared` | empty | the shared heap's [`HeapRef`], or `NotFound` |
//!
//! A call on a connection that attached no heap (its server restarted
//! since, say) fails with `InvalidArgument` and the metadata key
//! `dm-heap` set to `attach`: [`HeapChannel::call`] attaches its heap
//! again and makes the call once more. A handler asks for its
//! connection's heaps ([`HeapService::heaps`]) before it does anything
//! else, so that the first call had no effect.
//!
//! All processes of a pool are trusted by it (the pool's trust model):
//! the checks here keep one client's bug or stale reference away from
//! another client's data, not a process that forges another's heap.

use crate::arg::{Arg, Heaps, ARG_LEN};
use crate::error::HeapError;
use crate::header::HEAP_REF_LEN;
use crate::heap::{Heap, HeapRef};
use crate::seal::Seal;
use dm_pool::Pool;
use dm_rpc::{Client, Metadata, Node, Payload, Peer, RpcError, ServerBuilder, Status};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The method that attaches a client's heap to its connection.
pub const ATTACH: &str = "dm.heap/attach";
/// The method that answers the service's shared heap.
pub const SHARED: &str = "dm.heap/shared";
/// The metadata key of the error a call without a heap gets.
const NO_HEAP_KEY: &str = "dm-heap";

/// The largest private heap a service opens for a client by default.
pub const DEFAULT_PRIVATE_MAX: u64 = 1 << 30;

impl From<HeapError> for RpcError {
    fn from(e: HeapError) -> RpcError {
        let status = match e {
            HeapError::Pool(p) => return RpcError::from(p),
            HeapError::NoHeap => {
                let m = Metadata::new().with(NO_HEAP_KEY, "attach");
                return RpcError::invalid_argument(HeapError::NoHeap.to_string())
                    .with_metadata(m.unwrap_or_default());
            }
            HeapError::Full(_) | HeapError::NoAddress(_) => Status::ResourceExhausted,
            HeapError::Corrupt(_) => Status::Internal,
            _ => Status::InvalidArgument,
        };
        RpcError::new(status, e.to_string())
    }
}

/// A service's heaps: its clients' private heaps, by connection, and its
/// shared heap if it has one (see the module docs).
#[derive(Debug)]
pub struct HeapService {
    pool: Pool,
    shared: Option<Arc<Heap>>,
    /// The arguments' heaps of a connection that attached none.
    shared_only: Option<Arc<Heaps>>,
    private_max: u64,
    /// Each connection's heaps.
    peers: Mutex<HashMap<Peer, Attached>>,
}

/// A connection's own heap, and the heaps its arguments may be in: that
/// one and the shared one.
type Attached = (Arc<Heap>, Arc<Heaps>);

impl HeapService {
    /// Heaps for a service of `pool` whose clients each bring a private
    /// heap (of at most [`DEFAULT_PRIVATE_MAX`] bytes).
    pub fn new(pool: &Pool) -> HeapService {
        HeapService {
            pool: pool.clone(),
            shared: None,
            shared_only: None,
            private_max: DEFAULT_PRIVATE_MAX,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// As [`new`](Self::new), with a heap of `len` bytes shared by all
    /// the service's clients.
    pub fn with_shared(pool: &Pool, len: u64) -> Result<HeapService, HeapError> {
        let shared = Heap::create(pool, len)?.held();
        Ok(HeapService {
            shared_only: Some(Arc::new(Heaps::only([shared.clone()]))),
            shared: Some(shared),
            ..HeapService::new(pool)
        })
    }

    /// Refuses a client's private heap larger than `bytes`: each one a
    /// service holds open counts against its own quota too.
    pub fn private_max(mut self, bytes: u64) -> HeapService {
        self.private_max = bytes;
        self
    }

    /// Adds the methods of heaps ([`ATTACH`], [`SHARED`]) to the
    /// service `b` builds, and lets a connection's heap go when the
    /// connection closes (this takes the server's disconnect hook).
    pub fn serve(self: &Arc<Self>, b: ServerBuilder) -> ServerBuilder {
        let (attach, gone) = (self.clone(), Arc::downgrade(self));
        let shared = self.shared.as_ref().map(|h| h.clone());
        b.method(ATTACH, move |call| {
            let r = call.payload().to_vec()?;
            attach.attach(call.peer(), &r)?;
            Ok(Payload::empty())
        })
        .method(SHARED, move |_| match &shared {
            Some(h) => Ok(Payload::from_vec(h.shared_ref()?.to_bytes().to_vec())),
            None => Err(RpcError::not_found("the service has no shared heap")),
        })
        .on_disconnect(move |peer| {
            if let Some(s) = gone.upgrade() {
                s.peers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&peer);
            }
        })
    }

    /// Makes the heap `r` names connection `peer`'s.
    fn attach(&self, peer: Peer, r: &[u8]) -> Result<(), HeapError> {
        if r.len() != HEAP_REF_LEN {
            return Err(HeapError::BadRef(r.len()));
        }
        let r = HeapRef::from_bytes(r)?;
        if r.len() > self.private_max {
            return Err(HeapError::BadSize(r.len()));
        }
        if self
            .shared
            .as_ref()
            .is_some_and(|s| s.base() as u64 == r.addr())
        {
            return Err(HeapError::BadArg(
                "the service's shared heap is not a connection's own",
            ));
        }
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if peers
            .iter()
            .any(|(p, (h, _))| *p != peer && h.base() as u64 == r.addr())
        {
            return Err(HeapError::BadArg("another connection's heap"));
        }
        let heap = Heap::open_held(&self.pool, &r)?;
        let heaps = Heaps::only(std::iter::once(heap.clone()).chain(self.shared.clone()));
        peers.insert(peer, (heap, Arc::new(heaps)));
        Ok(())
    }

    /// The heaps connection `peer`'s arguments may be in: its own and the
    /// shared one. `NoHeap` if it attached none and the service has no
    /// shared heap.
    pub fn heaps(&self, peer: Peer) -> Result<Arc<Heaps>, HeapError> {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        match peers.get(&peer) {
            Some((_, heaps)) => Ok(heaps.clone()),
            None => self.shared_only.clone().ok_or(HeapError::NoHeap),
        }
    }

    /// Connection `peer`'s own heap, to build its answers in. `NoHeap`
    /// if it attached none.
    pub fn private(&self, peer: Peer) -> Result<Arc<Heap>, HeapError> {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        peers
            .get(&peer)
            .map(|(h, _)| h.clone())
            .ok_or(HeapError::NoHeap)
    }

    /// The heap all the service's clients share, if it has one.
    pub fn shared(&self) -> Option<&Arc<Heap>> {
        self.shared.as_ref()
    }

    /// How many connections have a heap attached.
    pub fn connections(&self) -> usize {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// A connection to a service with a heap of its own, and the service's
/// shared heap if it has one (see the module docs).
#[derive(Debug)]
pub struct HeapChannel {
    client: Client,
    heap: Arc<Heap>,
    shared: Option<Arc<Heap>>,
    /// Where answers may be: the two heaps above.
    heaps: Heaps,
}

impl HeapChannel {
    /// Connects to `service` with a private heap of `len` bytes.
    pub fn connect(node: &Node, service: &str, len: u64) -> Result<HeapChannel, RpcError> {
        HeapChannel::over(node.connect(service)?, node.pool(), len)
    }

    /// Makes a heap of `len` bytes in `pool` the connection `client`'s,
    /// and opens its service's shared heap.
    pub fn over(client: Client, pool: &Pool, len: u64) -> Result<HeapChannel, RpcError> {
        let heap = Heap::create(pool, len)?.held();
        attach(&client, &heap)?;
        let shared = match client.call(SHARED, Payload::empty()) {
            Ok(a) => Some(Heap::open_held(pool, &HeapRef::from_bytes(&a.to_vec()?)?)?),
            Err(e) if e.status == Status::NotFound => None,
            Err(e) => return Err(e),
        };
        let heaps = Heaps::only(std::iter::once(heap.clone()).chain(shared.clone()));
        Ok(HeapChannel {
            client,
            heap,
            shared,
            heaps,
        })
    }

    /// The connection's own heap.
    pub fn heap(&self) -> &Heap {
        &self.heap
    }

    /// The heap the service's clients share, if it has one.
    pub fn shared(&self) -> Option<&Heap> {
        self.shared.as_deref()
    }

    /// The connection, for calls of plain bytes.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The heap of the two that holds `value`.
    fn holder<T>(&self, value: &T) -> Result<&Heap, HeapError> {
        std::iter::once(&*self.heap)
            .chain(self.shared.as_deref())
            .find(|h| h.offset_of(value).is_some())
            .ok_or(HeapError::Foreign(value as *const T as u64))
    }

    /// The bytes that pass `value`, in either heap of the channel.
    pub fn arg<T>(&self, value: &T) -> Result<[u8; ARG_LEN], HeapError> {
        self.holder(value)?.arg(value)
    }

    /// Calls `method` with `value` (in either heap) as its argument.
    pub fn call<T>(&self, method: &str, value: &T) -> Result<Payload, RpcError> {
        let a = self.arg(value)?;
        self.call_bytes(method, &a)
    }

    /// Calls `method` with `value`, in a scope `seal` holds still.
    pub fn call_sealed<T>(
        &self,
        method: &str,
        value: &T,
        seal: &Seal<'_>,
    ) -> Result<Payload, RpcError> {
        let a = self.holder(value)?.sealed_arg(value, seal)?;
        self.call_bytes(method, &a)
    }

    /// One call of an argument's bytes; if its connection has no heap (a
    /// new server), the heap is attached again and the call made once
    /// more.
    fn call_bytes(&self, method: &str, a: &[u8; ARG_LEN]) -> Result<Payload, RpcError> {
        match self.client.call(method, Payload::from_vec(a.to_vec())) {
            Err(e) if e.metadata.get(NO_HEAP_KEY) == Some(b"attach") => {
                self.reattach()?;
                self.client.call(method, Payload::from_vec(a.to_vec()))
            }
            r => r,
        }
    }

    /// Attaches the heap to the connection again (after its server
    /// restarted: [`call`](Self::call) does it by itself).
    pub fn reattach(&self) -> Result<(), RpcError> {
        attach(&self.client, &self.heap)
    }

    /// The `R` an answer passes (a value the service built in one of
    /// the channel's heaps and answered with [`Heap::arg`]).
    pub fn answer<R>(&self, answer: &Payload) -> Result<Arg<R>, HeapError> {
        let b = answer
            .to_vec()
            .map_err(|_| HeapError::BadArg("an answer that cannot be read"))?;
        self.heaps.arg(&b)
    }
}

/// Attaches `heap` to `client`'s connection.
fn attach(client: &Client, heap: &Heap) -> Result<(), RpcError> {
    let r = heap.shared_ref()?.to_bytes();
    client.call(ATTACH, Payload::from_vec(r.to_vec()))?;
    Ok(())
}
