package raftstore

import (
	"sync"

	bolt "go.etcd.io/bbolt"

	storpb "github.com/stor-io/stor/api/proto"
)

// VolumeEvent is a committed change to one volume.
type VolumeEvent struct {
	// Volume as of Index; nil when Deleted.
	Volume  *storpb.Volume
	Index   uint64
	Deleted bool

	id string // the volume's id, for routing
}

// watchBuffer is how many events a watcher may fall behind before it is
// dropped (its channel closed). A dropped watcher re-watches and gets the
// current state first, so it loses no state, only intermediate steps.
const watchBuffer = 64

// watchHub fans committed volume changes out to watchers.
type watchHub struct {
	mu   sync.Mutex
	subs map[string]map[*watcher]struct{} // volume id -> watchers
	n    int                              // number of watchers, for a cheap any()
}

type watcher struct {
	ch chan VolumeEvent
}

func newWatchHub() *watchHub {
	return &watchHub{subs: map[string]map[*watcher]struct{}{}}
}

func (h *watchHub) any() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n > 0
}

func (h *watchHub) add(volumeID string) *watcher {
	h.mu.Lock()
	defer h.mu.Unlock()
	w := &watcher{ch: make(chan VolumeEvent, watchBuffer)}
	if h.subs[volumeID] == nil {
		h.subs[volumeID] = map[*watcher]struct{}{}
	}
	h.subs[volumeID][w] = struct{}{}
	h.n++
	return w
}

func (h *watchHub) remove(volumeID string, w *watcher) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.removeLocked(volumeID, w)
}

func (h *watchHub) removeLocked(volumeID string, w *watcher) {
	set := h.subs[volumeID]
	if _, ok := set[w]; !ok {
		return
	}
	delete(set, w)
	if len(set) == 0 {
		delete(h.subs, volumeID)
	}
	h.n--
	close(w.ch)
}

func (h *watchHub) publish(volumeID string, ev VolumeEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for w := range h.subs[volumeID] {
		select {
		case w.ch <- ev:
		default:
			h.removeLocked(volumeID, w) // too slow: drop it
		}
	}
}

func (h *watchHub) watched() map[string]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]bool, len(h.subs))
	for id := range h.subs {
		out[id] = true
	}
	return out
}

func (h *watchHub) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for id, set := range h.subs {
		for w := range set {
			h.removeLocked(id, w)
		}
	}
}

// Watch returns a channel of committed changes to one volume and a cancel
// function. The first event is the volume's current state (Deleted if it
// does not exist); then one event per committed change, in index order.
// The channel is closed when cancel is called, when the watcher falls more
// than a buffer behind, or when the FSM closes; a consumer that sees the
// channel close without cancelling should watch again.
func (f *FSM) Watch(volumeID string) (<-chan VolumeEvent, func()) {
	// Subscribe and read the current state with applies excluded: a batch
	// either committed before (the read sees it) or starts after (it sees
	// the subscriber and publishes its changes).
	var first VolumeEvent
	f.mu.Lock()
	w := f.hub.add(volumeID)
	err := ErrClosed
	if f.db != nil {
		err = f.db.View(func(tx *bolt.Tx) error {
			r := &Reader{tx: tx}
			first.Index = r.AppliedIndex()
			v, err := r.Volume(volumeID)
			first.Volume, first.Deleted = v, err != nil
			return nil
		})
	}
	f.mu.Unlock()
	if err != nil {
		f.hub.remove(volumeID, w)
	}
	out := make(chan VolumeEvent, watchBuffer+1)
	done := make(chan struct{})
	var once sync.Once
	cancel := func() {
		once.Do(func() {
			close(done)
			f.hub.remove(volumeID, w)
		})
	}
	go func() {
		defer close(out)
		if err != nil {
			return
		}
		out <- first
		last := first.Index
		for {
			select {
			case ev, ok := <-w.ch:
				if !ok {
					return
				}
				if ev.Index <= last {
					continue // already reflected in what this watcher saw
				}
				last = ev.Index
				select {
				case out <- ev:
				case <-done:
					return
				}
			case <-done:
				return
			}
		}
	}()
	return out, cancel
}
