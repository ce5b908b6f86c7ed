package idem

import (
	"container/list"
	"fmt"
	"sync"
	"time"
)

// CacheConfig configures Config.Cache, the in-process cache of completed
// outcomes. Every field's zero value means its default.
type CacheConfig struct {
	// Size is the most keys kept (least recently used first out).
	// Default 10000; at most 10,000,000.
	Size int
	// MaxAge is how long an outcome is served from the cache after it was
	// read from the database. Default 30 seconds; at most 5 minutes.
	MaxAge time.Duration
}

// Defaults of CacheConfig.
const (
	DefaultCacheSize   = 10000
	DefaultCacheMaxAge = 30 * time.Second
)

// cacheFresh is how recent the cache's listener must have been heard from
// (a notification or its own ping, every cachePing) for the cache to
// answer; idem.release callers wait ReleaseGrace, longer than that.
const (
	cachePing  = 500 * time.Millisecond
	cacheFresh = 1500 * time.Millisecond
	// ReleaseGrace is how long after idem.release committed every
	// process's cache has dropped the key or stopped answering (its
	// listener not heard from within 1.5 s): idemctl release waits it out
	// before it returns.
	ReleaseGrace = 2 * time.Second
	// cacheExpiryMargin: an outcome is cached only while its key's
	// retention, by this process's clock, outlasts MaxAge by this much
	// (a skewed clock errs by serving a completed answer, never by
	// running the work again).
	cacheExpiryMargin = time.Minute
)

func (c *CacheConfig) validate() error {
	switch {
	case c.Size < 0 || c.Size > 10_000_000:
		return fmt.Errorf("%w: Cache.Size %d must be between 1 and 10,000,000 (0 for %d)", ErrInvalidConfig, c.Size, DefaultCacheSize)
	case c.MaxAge < 0 || c.MaxAge > 5*time.Minute:
		return fmt.Errorf("%w: Cache.MaxAge %v must be between 1ms and 5 minutes (0 for %v)", ErrInvalidConfig, c.MaxAge, DefaultCacheMaxAge)
	}
	return nil
}

// cache is a bounded LRU of completed claims by key digest (waitKey).
type cache struct {
	size   int
	maxAge time.Duration

	mu    sync.Mutex
	lru   *list.List // of *cacheEntry, most recent first
	byKey map[string]*list.Element
	gen   uint64 // bumped by every release heard and every listener restart
}

type cacheEntry struct {
	digest      string
	fingerprint string
	claim       Claim
	until       time.Time // by this process's monotonic clock
}

func newCache(cfg CacheConfig) *cache {
	if cfg.Size == 0 {
		cfg.Size = DefaultCacheSize
	}
	if cfg.MaxAge == 0 {
		cfg.MaxAge = DefaultCacheMaxAge
	}
	return &cache{size: cfg.Size, maxAge: cfg.MaxAge, lru: list.New(), byKey: map[string]*list.Element{}}
}

// get returns a copy of the cached completed claim of (source, key) with
// that fingerprint, if any and still young.
func (c *cache) get(digest, fingerprint string) (*Claim, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[digest]
	if !ok {
		return nil, false
	}
	e := el.Value.(*cacheEntry)
	if time.Now().After(e.until) {
		c.lru.Remove(el)
		delete(c.byKey, digest)
		return nil, false
	}
	if e.fingerprint != fingerprint {
		return nil, false // the database decides: a mismatch, or not
	}
	c.lru.MoveToFront(el)
	cl := e.claim
	if cl.Result != nil {
		cl.Result = append(cl.Result[:0:0], cl.Result...) // the caller's own copy
	}
	return &cl, true
}

// generation is read before a claim goes to the database; put stores its
// answer only if no release was heard meanwhile.
func (c *cache) generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// put caches a completed claim read at generation gen.
func (c *cache) put(digest, fingerprint string, cl *Claim, gen uint64) {
	if cl.Outcome != Completed {
		return
	}
	now := time.Now()
	if !cl.ExpiresAt.IsZero() && cl.ExpiresAt.Sub(now) < c.maxAge+cacheExpiryMargin {
		return // near the end of its retention: ask the database
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen != c.gen {
		return // a release was heard while the claim was read
	}
	e := &cacheEntry{digest: digest, fingerprint: fingerprint, claim: *cl, until: now.Add(c.maxAge)}
	if cl.Result != nil {
		// A copy: the caller that filled the cache holds cl.Result.
		e.claim.Result = append(cl.Result[:0:0], cl.Result...)
	}
	if el, ok := c.byKey[digest]; ok {
		el.Value = e
		c.lru.MoveToFront(el)
		return
	}
	c.byKey[digest] = c.lru.PushFront(e)
	for c.lru.Len() > c.size {
		old := c.lru.Back()
		c.lru.Remove(old)
		delete(c.byKey, old.Value.(*cacheEntry).digest)
	}
}

// drop forgets a released key ("" forgets every key: the listener missed
// what happened while it was away).
func (c *cache) drop(digest string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	if digest == "" {
		c.lru.Init()
		clear(c.byKey)
		return
	}
	if el, ok := c.byKey[digest]; ok {
		c.lru.Remove(el)
		delete(c.byKey, digest)
	}
}
