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
	// ReleaseGrace is how long after idem.release committed the release
	// takes effect: the key's retention ends then (migration 15), and by
	// then every process's cache has dropped the key or stopped answering
	// (its listener not heard from within 1.5 s). Until then the database
	// and the caches alike answer Completed. idemctl release waits it out
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

// cache is a bounded LRU of completed claims. An entry is found by its
// exact (source, key), JoinKey's unambiguous encoding of the pair, never
// by a digest: two keys never share an entry. Releases are heard as the
// digest of idem.wait_channel_key, so entries are also indexed by it, and a
// release drops every entry with that digest (two keys sharing one only
// lose their cached answer, which the database gives again).
type cache struct {
	size   int
	maxAge time.Duration

	mu       sync.Mutex
	lru      *list.List // of *cacheEntry, most recent first
	byKey    map[string]*list.Element
	byDigest map[string]map[*list.Element]struct{}
	gen      uint64 // bumped by every release heard and every listener restart
}

type cacheEntry struct {
	id          string // JoinKey(source, key)
	digest      string // waitKey(source, key), as releases name it
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
	return &cache{size: cfg.Size, maxAge: cfg.MaxAge, lru: list.New(), byKey: map[string]*list.Element{},
		byDigest: map[string]map[*list.Element]struct{}{}}
}

// get returns a copy of the cached completed claim of (source, key) with
// that fingerprint, if any and still young.
func (c *cache) get(source, key, fingerprint string) (*Claim, bool) {
	id := JoinKey(source, key)
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[id]
	if !ok {
		return nil, false
	}
	e := el.Value.(*cacheEntry)
	if time.Now().After(e.until) {
		c.removeLocked(el)
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

// put caches a completed claim of (source, key) read at generation gen.
func (c *cache) put(source, key, fingerprint string, cl *Claim, gen uint64) {
	if cl.Outcome != Completed {
		return
	}
	now := time.Now()
	if !cl.ExpiresAt.IsZero() && cl.ExpiresAt.Sub(now) < c.maxAge+cacheExpiryMargin {
		return // near the end of its retention: ask the database
	}
	id, digest := JoinKey(source, key), waitKey(source, key)
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen != c.gen {
		return // a release was heard while the claim was read
	}
	e := &cacheEntry{id: id, digest: digest, fingerprint: fingerprint, claim: *cl, until: now.Add(c.maxAge)}
	if cl.Result != nil {
		// A copy: the caller that filled the cache holds cl.Result.
		e.claim.Result = append(cl.Result[:0:0], cl.Result...)
	}
	if el, ok := c.byKey[id]; ok {
		el.Value = e
		c.lru.MoveToFront(el)
		return
	}
	el := c.lru.PushFront(e)
	c.byKey[id] = el
	if c.byDigest[digest] == nil {
		c.byDigest[digest] = map[*list.Element]struct{}{}
	}
	c.byDigest[digest][el] = struct{}{}
	for c.lru.Len() > c.size {
		c.removeLocked(c.lru.Back())
	}
}

// removeLocked forgets one entry; c.mu is held.
func (c *cache) removeLocked(el *list.Element) {
	e := el.Value.(*cacheEntry)
	c.lru.Remove(el)
	delete(c.byKey, e.id)
	if set := c.byDigest[e.digest]; set != nil {
		delete(set, el)
		if len(set) == 0 {
			delete(c.byDigest, e.digest)
		}
	}
}

// drop forgets the keys whose release digest (waitKey) is digest ("" forgets
// every key: the listener missed what happened while it was away).
func (c *cache) drop(digest string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	if digest == "" {
		c.lru.Init()
		clear(c.byKey)
		clear(c.byDigest)
		return
	}
	for el := range c.byDigest[digest] {
		c.removeLocked(el)
	}
}
