//! Quotas: per process (set for the pool and per attach) and per tenant
//! (shared by the processes that attach as it, across processes). Past a
//! quota an allocation or a mapping is `ResourceExhausted` naming it, and
//! the pool stays usable; what is freed, turned into a Ref, or held by a
//! process that died is given back.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

mod common;
use common::{Agent, TempPool};
use dm_pool::{AttachOptions, Error, PoolConfig};

const PAGE: u64 = 4096;

fn pool() -> TempPool {
    TempPool::with(PoolConfig {
        size: 16 << 20,
        process_quota: Some(64 * PAGE),
        tenants: vec![("shop".into(), 96 * PAGE), ("search".into(), 1 << 20)],
        ..Default::default()
    })
}

fn quota_error(e: &Error) -> Option<&'static str> {
    match e {
        Error::ResourceExhausted { what } => Some(what),
        _ => None,
    }
}

#[test]
fn a_process_quota_bounds_its_buffers_and_gives_back_what_is_freed() {
    let tp = pool();
    let p = tp.attach();
    assert_eq!(
        dm_pool::check_path(&tp.path, false)
            .unwrap()
            .process_quota_pages,
        64
    );
    let a = p.alloc(48 * PAGE).unwrap();
    let e = p.alloc(32 * PAGE).unwrap_err();
    assert_eq!(quota_error(&e), Some("process quota"), "{e}");
    assert!(e.to_string().contains("--process-quota"), "{e}");
    // Nothing was taken by the refusal: 16 pages are still free to take.
    let b = p.alloc(16 * PAGE).unwrap();
    // A buffer turned into a Ref leaves the quota (a Ref is bounded by
    // its TTL); mapping it back charges again.
    let r = p.into_ref(a).unwrap();
    let c = p.alloc(48 * PAGE).unwrap();
    let e = p.map_ref(&r).unwrap_err();
    assert_eq!(quota_error(&e), Some("process quota"), "{e}");
    p.free(c).unwrap();
    let m = p.map_ref(&r).unwrap();
    assert_eq!(m.len(), 48 * PAGE);
    drop((m, b));
    p.release_ref(&r).unwrap();
    // An attach may ask for less than the pool's quota, never more.
    let small = tp.attach_with(AttachOptions {
        quota: Some(8 * PAGE),
        ..Default::default()
    });
    assert!(small.alloc(9 * PAGE).is_err());
    small.free(small.alloc(8 * PAGE).unwrap()).unwrap();
    let big = tp.attach_with(AttachOptions {
        quota: Some(1 << 30),
        ..Default::default()
    });
    assert!(
        big.alloc(65 * PAGE).is_err(),
        "the pool's quota still holds"
    );
    drop((p, small, big));
    tp.assert_clean();
}

#[test]
fn an_unknown_tenant_is_refused_naming_the_tenants() {
    let tp = pool();
    let e = dm_pool::Pool::open(
        &tp.path,
        AttachOptions {
            tenant: Some("ads".into()),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("shop") && m.contains("search") && m.contains("--tenant"),
        "{m}"
    );
}

#[test]
fn pool_configs_with_bad_tenants_are_refused() {
    for tenants in [
        vec![("".to_owned(), 1u64 << 20)],
        vec![("x".repeat(25), 1 << 20)],
        vec![("a".into(), 0)],
        vec![("a".into(), 1 << 20), ("a".into(), 1 << 20)],
        (0..17).map(|i| (format!("t{i}"), 1 << 20)).collect(),
    ] {
        let cfg = PoolConfig {
            size: 16 << 20,
            tenants: tenants.clone(),
            ..Default::default()
        };
        let path = std::env::temp_dir().join(format!("dm-quota-bad-{}", std::process::id()));
        let e = dm_pool::Pool::create(&path, &cfg).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{tenants:?}: {e}");
        assert!(!path.exists());
    }
}

/// An agent process attached as `tenant`.
fn agent(tp: &TempPool, tenant: &str) -> Agent {
    Agent::spawn_with(&tp.path, None, &[("DMRPC_TENANT", tenant)], false)
}

/// Two processes of one tenant share its quota; a third of another
/// tenant does not; a killed process's charge goes back to its tenant.
#[test]
fn a_tenant_quota_is_shared_by_its_processes() {
    let tp = pool();
    let mut a = agent(&tp, "shop");
    let mut b = agent(&tp, "shop");
    let mut c = agent(&tp, "search");
    assert!(a.raw(&format!("alloc {}", 60 * PAGE)).starts_with("ok "));
    let refused = b.raw(&format!("alloc {}", 40 * PAGE));
    assert!(refused.contains("tenant quota"), "{refused}");
    assert!(b.raw(&format!("alloc {}", 36 * PAGE)).starts_with("ok "));
    assert!(c.raw(&format!("alloc {}", 60 * PAGE)).starts_with("ok "));
    let shop = |tp: &TempPool| {
        let r = dm_pool::check_path(&tp.path, false).unwrap();
        r.quotas
            .iter()
            .find(|q| q.who == "tenant shop")
            .map(|q| (q.held_pages, q.quota_pages))
            .unwrap()
    };
    assert_eq!(shop(&tp), (96, 96));
    // Killed: its 60 pages go back to the tenant when it is reclaimed.
    a.kill9();
    dm_pool::gc_path(&tp.path).unwrap();
    assert_eq!(shop(&tp), (36, 96));
    assert!(b.raw(&format!("alloc {}", 28 * PAGE)).starts_with("ok "));
    for x in [b, c] {
        x.exit();
    }
    assert_eq!(shop(&tp), (0, 96));
    tp.assert_clean();
}

/// An allocation refused for want of pages (its page lists) gives its
/// charge back: what the quota counts is exactly what is held.
#[test]
fn a_refused_allocation_leaves_no_charge() {
    let tp = TempPool::with(PoolConfig {
        size: 8 << 20,
        descs: Some(8192),
        process_quota: Some(1 << 30),
        ..Default::default()
    });
    let p = tp.attach();
    // Every page written, one buffer each, until none is left.
    let mut held = Vec::new();
    loop {
        let Ok(mut b) = p.alloc(PAGE) else { break };
        let full = b.write(0, &[1]).is_err();
        held.push(b);
        if full {
            break;
        }
    }
    let pages = held.len() as u64;
    // The pool is full: a large buffer needs list pages, and is refused.
    let e = p.alloc(4 << 20).unwrap_err();
    assert_eq!(quota_error(&e), Some("pages"), "{e}");
    let q = dm_pool::check_path(&tp.path, false).unwrap().quotas;
    let mine = q.iter().find(|q| q.who.starts_with("process")).unwrap();
    assert_eq!(mine.held_pages, pages, "{q:?}");
    drop((held, p));
    tp.assert_clean();
}
