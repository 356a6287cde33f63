//! The social network: a workload in the spirit of DeathStarBench's
//! social network, built as real dmrpc services, where posts carry media
//! blobs (16–256 KiB) that pass through several services.
//!
//! ```text
//! compose:  client → frontend → compose-post → text → media → post-storage
//!                                   ├→ user-timeline  (append the post's id)
//!                                   └→ home-timeline  (fan the id out to followers)
//! reads:    client → frontend → home-timeline | user-timeline → post-storage
//! ```
//!
//! * **frontend** routes `compose`, `home` and `user` to the services.
//! * **compose-post** gives the post its id (an 8-byte write into the
//!   post: by Ref, copy-on-write copies one page), sends it down the chain
//!   to storage, then updates the author's timeline and fans the id out to
//!   the followers' home timelines.
//! * **text** checks the text (length, UTF-8, no banned word); **media**
//!   checks the media header. Both read only their part and forward the
//!   post untouched.
//! * **post-storage** keeps posts (by Ref: [`Payload::keep`], the pages
//!   shared, no copy) up to a capacity, evicting the oldest, and answers
//!   `get` with the post (by Ref: its pages shared again).
//! * **user-timeline** and **home-timeline** keep the latest post ids per
//!   user; a read answers the latest post of the user's timeline, fetched
//!   from storage and passed back through the timeline and the frontend
//!   (empty if the timeline is).
//!
//! Users follow the next [`FOLLOWS`] users (mod the number of users).
//!
//! # Post format, version 1
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 8    | magic `DMPOST` 0 `1`                    |
//! | 8      | 8    | post id (0 until compose-post sets it)  |
//! | 16     | 4    | author                                  |
//! | 20     | 4    | text length *t*                         |
//! | 24     | 4    | media length *m*                        |
//! | 28     | 4    | reserved, zero                          |
//! | 32     | *t*  | text, UTF-8                             |
//! | 32+*t* | *m*  | media: `DMMEDIA1`, u64 seed, then bytes |
//!
//! Small requests are little-endian integers: `home`/`user` a u32 user,
//! `get` a u64 post id, `append`/`fanout` a u32 author then a u64 id.

pub use super::Link;
use super::{u32_at, u64_at, Next};

use dm_rpc::{Node, Payload, RpcError, Server, Transport};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Bytes of a post's header.
pub const POST_HEADER: usize = 32;
/// A post's magic (its last byte is the format version).
pub const MAGIC: [u8; 8] = *b"DMPOST\x001";
/// The media blob's magic.
pub const MEDIA_MAGIC: [u8; 8] = *b"DMMEDIA1";
/// Bytes of the media header (magic, seed).
pub const MEDIA_HEADER: usize = 16;
/// How many users each user follows.
pub const FOLLOWS: u32 = 8;
/// Post ids kept per timeline.
pub const TIMELINE_LEN: usize = 16;
/// The longest text.
pub const MAX_TEXT: usize = 4096;
/// The largest media blob.
pub const MAX_MEDIA: usize = 4 << 20;
/// A word the text service refuses.
pub const BANNED: &str = "spam";

fn invalid(m: impl Into<String>) -> RpcError {
    RpcError::invalid_argument(m)
}

/// A post's header, as read from its first 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostHeader {
    /// Its id (0 before compose-post).
    pub id: u64,
    /// Who wrote it.
    pub author: u32,
    /// Bytes of text.
    pub text: u32,
    /// Bytes of media.
    pub media: u32,
}

impl PostHeader {
    /// Parses and checks a header against the post's length.
    pub fn parse(h: &[u8; POST_HEADER], len: u64) -> Result<PostHeader, RpcError> {
        if h[..8] != MAGIC {
            return Err(invalid("not a post of format version 1"));
        }
        let p = PostHeader {
            id: u64_at(h, 8),
            author: u32_at(h, 16),
            text: u32_at(h, 20),
            media: u32_at(h, 24),
        };
        if p.text as usize > MAX_TEXT || p.media as usize > MAX_MEDIA || u32_at(h, 28) != 0 {
            return Err(invalid(format!(
                "a post of {} bytes of text and {} of media is too large",
                p.text, p.media
            )));
        }
        if (POST_HEADER as u64 + p.text as u64 + p.media as u64) != len {
            return Err(invalid(format!(
                "a post's header says {} + {} bytes, it has {}",
                p.text,
                p.media,
                len.saturating_sub(POST_HEADER as u64)
            )));
        }
        Ok(p)
    }

    fn read(p: &Payload) -> Result<PostHeader, RpcError> {
        if p.len() < POST_HEADER as u64 {
            return Err(invalid("a post shorter than its header"));
        }
        let mut h = [0u8; POST_HEADER];
        p.read(0, &mut h)?;
        PostHeader::parse(&h, p.len())
    }
}

/// The media bytes for `seed`: a header then deterministic noise.
pub fn media(len: usize, seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(MEDIA_HEADER));
    v.extend_from_slice(&MEDIA_MAGIC);
    v.extend_from_slice(&seed.to_le_bytes());
    let mut x = seed | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len.max(MEDIA_HEADER));
    v
}

/// A new post (id 0) by `author` with `text` and a media blob of
/// `media_len` bytes from `seed`.
pub fn post(author: u32, text: &str, media_len: usize, seed: u64) -> Vec<u8> {
    let m = media(media_len, seed);
    let mut v = Vec::with_capacity(POST_HEADER + text.len() + m.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&0u64.to_le_bytes());
    v.extend_from_slice(&author.to_le_bytes());
    v.extend_from_slice(&(text.len() as u32).to_le_bytes());
    v.extend_from_slice(&(m.len() as u32).to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(text.as_bytes());
    v.extend_from_slice(&m);
    v
}

/// Checks a post a read returned: its header, and, with `full`, that its
/// media is what its seed generates. Returns the header.
pub fn verify(p: &[u8], full: bool) -> Result<PostHeader, RpcError> {
    let h: &[u8; POST_HEADER] = p
        .get(..POST_HEADER)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| invalid("a post shorter than its header"))?;
    let hd = PostHeader::parse(h, p.len() as u64)?;
    let m = &p[POST_HEADER + hd.text as usize..];
    if m.len() < MEDIA_HEADER || m[..8] != MEDIA_MAGIC {
        return Err(invalid("bad media header"));
    }
    if full && *m != *media(m.len(), u64_at(m, 8)) {
        return Err(invalid("the media is not what its seed makes"));
    }
    Ok(hd)
}

/// The users `author`'s posts fan out to (those who follow them).
pub fn followers(author: u32, users: u32) -> impl Iterator<Item = u32> {
    (1..=FOLLOWS.min(users.saturating_sub(1))).map(move |k| (author + users - k) % users)
}

/// A service of the application and the services it calls.
#[derive(Debug, Clone)]
pub enum Role {
    /// Routes `compose`, `home`, `user`.
    Frontend {
        /// compose-post.
        compose: Link,
        /// home-timeline.
        home: Link,
        /// user-timeline.
        user: Link,
    },
    /// Gives posts ids, stores them, updates timelines.
    ComposePost {
        /// The text service (the chain to storage starts there).
        text: Link,
        /// user-timeline.
        user: Link,
        /// home-timeline.
        home: Link,
    },
    /// Checks the text, forwards to `next` (media).
    Text {
        /// The media service.
        next: Link,
    },
    /// Checks the media header, forwards to `next` (storage).
    Media {
        /// post-storage.
        next: Link,
    },
    /// Keeps up to `capacity` posts.
    PostStorage {
        /// Posts kept before the oldest is evicted.
        capacity: usize,
    },
    /// The latest post ids of each user's own posts.
    UserTimeline {
        /// post-storage.
        storage: Link,
    },
    /// The latest post ids of the users each user follows.
    HomeTimeline {
        /// post-storage.
        storage: Link,
        /// Users in the graph.
        users: u32,
    },
}

#[derive(Debug, Default)]
struct Storage {
    /// Posts kept past the calls that brought them ([`Payload::keep`]).
    posts: HashMap<u64, Payload>,
    order: VecDeque<u64>,
}

type Timelines = Mutex<HashMap<u32, VecDeque<u64>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn small(p: &Payload, n: usize, what: &str) -> Result<Vec<u8>, RpcError> {
    let v = p.to_vec()?;
    if v.len() != n {
        return Err(invalid(format!("{what} takes {n} bytes, not {}", v.len())));
    }
    Ok(v)
}

/// The latest post of `user` in `tl`, fetched from `storage` (empty if
/// there is none, or it was evicted).
fn latest(tl: &Timelines, storage: &Next, p: &Payload) -> Result<Payload, RpcError> {
    let user = u32_at(&small(p, 4, "a timeline read")?, 0);
    let id = lock(tl).get(&user).and_then(|q| q.back().copied());
    match id {
        Some(id) => storage.call("get", Payload::from_vec(id.to_le_bytes().to_vec())),
        None => Ok(Payload::empty()),
    }
}

fn push(tl: &Timelines, user: u32, id: u64) {
    let mut t = lock(tl);
    let q = t.entry(user).or_default();
    q.push_back(id);
    if q.len() > TIMELINE_LEN {
        q.pop_front();
    }
}

/// Starts service `role` as `name` of `node` on `transport`.
pub fn serve(
    node: &Node,
    name: &str,
    role: Role,
    transport: Transport,
) -> Result<Server, RpcError> {
    let b = node.server(name).transport(transport);
    let b = match role {
        Role::Frontend {
            compose,
            home,
            user,
        } => {
            let (c, h, u) = (
                std::sync::Arc::new(Next::new(node, compose)),
                std::sync::Arc::new(Next::new(node, home)),
                std::sync::Arc::new(Next::new(node, user)),
            );
            b.method("compose", move |call| {
                c.call("compose", call.payload().forward()?)
            })
            .method("home", move |call| {
                h.call("read", call.payload().forward()?)
            })
            .method("user", move |call| {
                u.call("read", call.payload().forward()?)
            })
        }
        Role::ComposePost { text, user, home } => {
            let (t, u, h) = (
                Next::new(node, text),
                Next::new(node, user),
                Next::new(node, home),
            );
            let ids = AtomicU64::new(1);
            b.method("compose", move |call| {
                let hd = PostHeader::read(call.payload())?;
                let id =
                    ids.fetch_add(1, Ordering::Relaxed) | (u64::from(std::process::id()) << 40);
                // The id goes into the post: by Ref a write into shared
                // pages, so one page is copied (copy-on-write); inline, in
                // place.
                let mut p = call.take_payload();
                p.write(8, &id.to_le_bytes())?;
                t.call("store", p)?;
                let mut m = hd.author.to_le_bytes().to_vec();
                m.extend_from_slice(&id.to_le_bytes());
                u.call("append", Payload::from_vec(m.clone()))?;
                h.call("fanout", Payload::from_vec(m))?;
                Ok(Payload::from_vec(id.to_le_bytes().to_vec()))
            })
        }
        Role::Text { next } => {
            let next = Next::new(node, next);
            b.method("store", move |call| {
                let p = call.payload();
                let hd = PostHeader::read(p)?;
                let mut text = vec![0u8; hd.text as usize];
                p.read(POST_HEADER as u64, &mut text)?;
                let text = std::str::from_utf8(&text).map_err(|_| invalid("text is not UTF-8"))?;
                if text.to_lowercase().contains(BANNED) {
                    return Err(invalid("the text has a banned word"));
                }
                next.call("store", p.forward()?)
            })
        }
        Role::Media { next } => {
            let next = Next::new(node, next);
            b.method("store", move |call| {
                let p = call.payload();
                let hd = PostHeader::read(p)?;
                let mut m = [0u8; MEDIA_HEADER];
                if (hd.media as usize) < MEDIA_HEADER {
                    return Err(invalid("media shorter than its header"));
                }
                p.read(POST_HEADER as u64 + hd.text as u64, &mut m)?;
                if m[..8] != MEDIA_MAGIC {
                    return Err(invalid("bad media header"));
                }
                next.call("store", p.forward()?)
            })
        }
        Role::PostStorage { capacity } => {
            let st = std::sync::Arc::new(Mutex::new(Storage::default()));
            let st2 = st.clone();
            b.method("store", move |call| {
                let hd = PostHeader::read(call.payload())?;
                if hd.id == 0 {
                    return Err(invalid("a post without an id"));
                }
                // By Ref the pages are shared (no copy); inline bytes are
                // the payload's own.
                let kept = call.take_payload().keep()?;
                let evicted = {
                    let mut s = lock(&st);
                    if s.posts.insert(hd.id, kept).is_none() {
                        s.order.push_back(hd.id);
                    }
                    let mut out = Vec::new();
                    while s.order.len() > capacity.max(1) {
                        if let Some(old) = s.order.pop_front() {
                            out.extend(s.posts.remove(&old));
                        }
                    }
                    out
                };
                drop(evicted); // freed outside the lock
                Ok(Payload::empty())
            })
            .method("get", move |call| {
                let id = u64_at(&small(call.payload(), 8, "get")?, 0);
                let s = lock(&st2);
                match s.posts.get(&id) {
                    None => Ok(Payload::empty()),
                    Some(p) => p.forward(),
                }
            })
        }
        Role::UserTimeline { storage } => {
            let tl = std::sync::Arc::new(Timelines::default());
            let tl2 = tl.clone();
            let storage = Next::new(node, storage);
            b.method("append", move |call| {
                let v = small(call.payload(), 12, "append")?;
                push(&tl, u32_at(&v, 0), u64_at(&v, 4));
                Ok(Payload::empty())
            })
            .method("read", move |call| latest(&tl2, &storage, call.payload()))
        }
        Role::HomeTimeline { storage, users } => {
            let tl = std::sync::Arc::new(Timelines::default());
            let tl2 = tl.clone();
            let storage = Next::new(node, storage);
            b.method("fanout", move |call| {
                let v = small(call.payload(), 12, "fanout")?;
                let (author, id) = (u32_at(&v, 0), u64_at(&v, 4));
                for f in followers(author, users) {
                    push(&tl, f, id);
                }
                Ok(Payload::empty())
            })
            .method("read", move |call| latest(&tl2, &storage, call.payload()))
        }
    };
    b.spawn()
}

/// The services of the application, in an order in which each starts
/// after those it calls: (role name, role), with `at` naming each.
pub fn roles(at: &dyn Fn(&str) -> Link, users: u32, capacity: usize) -> Vec<(&'static str, Role)> {
    vec![
        ("storage", Role::PostStorage { capacity }),
        (
            "user-timeline",
            Role::UserTimeline {
                storage: at("storage"),
            },
        ),
        (
            "home-timeline",
            Role::HomeTimeline {
                storage: at("storage"),
                users,
            },
        ),
        (
            "media",
            Role::Media {
                next: at("storage"),
            },
        ),
        ("text", Role::Text { next: at("media") }),
        (
            "compose",
            Role::ComposePost {
                text: at("text"),
                user: at("user-timeline"),
                home: at("home-timeline"),
            },
        ),
        (
            "frontend",
            Role::Frontend {
                compose: at("compose"),
                home: at("home-timeline"),
                user: at("user-timeline"),
            },
        ),
    ]
}

/// Fuzz entry point shared by `fuzz/fuzz_targets/social_post.rs` and the
/// corpus replay test: a post's header and media as the services decode
/// them must answer or refuse, never panic; what parses is consistent.
#[doc(hidden)]
pub fn fuzz_post(data: &[u8]) {
    if let Ok(h) = verify(data, true) {
        assert_eq!(
            POST_HEADER + h.text as usize + h.media as usize,
            data.len(),
            "a post that parses is as long as its header says"
        );
    }
    if let Some(h) = data.get(..POST_HEADER).and_then(|h| h.try_into().ok()) {
        let _ = PostHeader::parse(h, data.len() as u64);
        let _ = PostHeader::read(&Payload::from_vec(data.to_vec()));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use dm_pool::testing::TempPool;
    use dm_pool::PoolConfig;
    use dm_rpc::{Config, Status};

    #[test]
    fn posts_parse_and_bad_ones_are_refused() {
        let p = post(3, "hello", 20_000, 9);
        let h = verify(&p, true).unwrap();
        assert_eq!((h.id, h.author, h.text, h.media), (0, 3, 5, 20_000));
        let mut bad = p.clone();
        bad[POST_HEADER + 5 + 100] ^= 1;
        assert!(verify(&bad, true).is_err());
        assert!(verify(&bad, false).is_ok());
        assert!(verify(&p[..p.len() - 1], false).is_err());
        assert!(verify(&p[..10], false).is_err());
        let mut big = p.clone();
        big[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(verify(&big, false).is_err());
        let f: Vec<u32> = followers(0, 100).collect();
        assert_eq!(f.len(), FOLLOWS as usize);
        assert!(f.contains(&99) && !f.contains(&0));
        assert_eq!(followers(0, 1).count(), 0);
    }

    /// The whole application in one process over shared-memory channels,
    /// by Ref and by value; then the pool is clean.
    #[test]
    fn posts_flow_to_timelines_and_back() {
        let tp = TempPool::with(PoolConfig {
            size: 128 << 20,
            channels: Some(48),
            ..Default::default()
        });
        let pool = tp.attach();
        let id = std::process::id();
        for (mode, inline_max) in [("ref", 0), ("value", usize::MAX)] {
            let node = Node::with_config(
                pool.clone(),
                Config {
                    inline_max,
                    ..Default::default()
                },
            );
            let name = |r: &str| format!("test/social/{id}/{mode}/{r}");
            let at = |r: &str| Link::Shm(name(r));
            let users = 20;
            let servers: Vec<Server> = roles(&at, users, 8)
                .into_iter()
                .map(|(r, role)| serve(&node, &name(r), role, Transport::Shm).unwrap())
                .collect();
            let fe = node.connect(&name("frontend")).unwrap();
            let read = |m: &str, u: u32| {
                fe.call(m, u.to_le_bytes().to_vec())
                    .unwrap()
                    .to_vec()
                    .unwrap()
            };
            assert!(read("home", 5).is_empty(), "no posts yet");
            // User 7 posts: their timeline and their followers' homes
            // show it, with an id, and the same media.
            let p = post(7, "a photo", 100_000, 77);
            let id1 = fe.call("compose", p.clone()).unwrap().to_vec().unwrap();
            let got = read("user", 7);
            let h = verify(&got, true).unwrap();
            assert_eq!(h.id.to_le_bytes().to_vec(), id1);
            assert!(got[16..] == p[16..]);
            for f in followers(7, users) {
                assert!(read("home", f) == got, "follower {f}");
            }
            assert!(read("home", 7).is_empty(), "one does not follow oneself");
            // Refused: a banned word, a bad header, a bad media header.
            let e = fe
                .call("compose", post(1, "buy SPAM", 20_000, 1))
                .unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{e}");
            let mut m = post(1, "x", 20_000, 1);
            m[POST_HEADER + 1] ^= 1;
            assert!(fe.call("compose", m).is_err());
            assert!(fe.call("compose", vec![1u8; 40]).is_err());
            assert!(fe.call("home", vec![1u8; 3]).is_err());
            // Storage keeps 8 posts: older ones are evicted and read empty.
            for k in 0..12 {
                fe.call("compose", post(9, "more", 16 << 10, k)).unwrap();
            }
            assert!(read("user", 7).is_empty(), "evicted");
            verify(&read("user", 9), true).unwrap();
            drop(fe);
            drop(servers);
        }
        drop(pool);
        tp.assert_clean();
    }
}
