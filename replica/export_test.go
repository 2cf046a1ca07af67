package replica

// FileCacheStats exposes the store's file cache counters to the external
// tests: files open now, file sets opened, and idle file sets closed.
func FileCacheStats(s *Store) (files int, opens, closes uint64) { return s.cache.stats() }

// LoadedLayers is how many of r's layers have their index in memory.
func LoadedLayers(r *Replica) int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	n := 0
	for _, l := range r.layers {
		if l.loaded {
			n++
		}
	}
	return n
}

// FilesOpen reports whether r's files are open.
func FilesOpen(r *Replica) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.filesOpen
}

// CloseIfIdle closes r's files if it is idle (review hook).
func CloseIfIdle(r *Replica) int { return r.closeIfIdle() }
