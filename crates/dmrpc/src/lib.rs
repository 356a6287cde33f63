pub use dm_pool as pool;
