//! Reading a call's items from `poll` functions (HTTP bodies, byte
//! streams), whose sources are read by `async` functions.

use dm_rpc::{AsyncInbox, AsyncStreaming, Payload, RpcError};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Where items come from: a call's answer (client side), or its caller's
/// items (server side). `None` once they end, and again after.
pub(crate) trait Source: Send + 'static {
    fn next(&mut self) -> impl Future<Output = Option<Result<Payload, RpcError>>> + Send;
}

impl Source for AsyncStreaming {
    async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        AsyncStreaming::next(self).await
    }
}

impl Source for AsyncInbox {
    async fn next(&mut self) -> Option<Result<Payload, RpcError>> {
        AsyncInbox::next(self).await
    }
}

/// One read of a source: the future that owns it until it gives an item.
type Step<S> = Pin<Box<dyn Future<Output = (Box<S>, Option<Result<Payload, RpcError>>)> + Send>>;

/// Reads a source one item at a time, from `poll` functions: between
/// reads it holds the source; during one, a future that owns it.
pub(crate) struct Reader<S> {
    idle: Option<Box<S>>,
    busy: Option<Step<S>>,
}

impl<S: Source> Reader<S> {
    pub(crate) fn new(s: S) -> Self {
        Reader {
            idle: Some(Box::new(s)),
            busy: None,
        }
    }

    /// The next non-empty item, or the end.
    pub(crate) fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Payload, RpcError>>> {
        loop {
            if let Some(mut s) = self.idle.take() {
                self.busy = Some(Box::pin(async move {
                    let got = s.next().await;
                    (s, got)
                }));
            }
            let Some(f) = &mut self.busy else {
                return Poll::Ready(None);
            };
            let (s, got) = std::task::ready!(f.as_mut().poll(cx));
            self.busy = None;
            self.idle = Some(s);
            match got {
                Some(Ok(p)) if p.is_empty() => continue,
                other => return Poll::Ready(other),
            }
        }
    }

    /// The source, between reads.
    pub(crate) fn source(&self) -> Option<&S> {
        self.idle.as_deref()
    }
}
