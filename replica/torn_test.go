package replica_test

import (
	"bytes"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// A read that overlaps a write returns, for every block, either the whole
// block before the write or the whole block after it, never a mix: a
// block is the unit the engine's and the NBD clients' checks rely on (the
// Jepsen harness found a torn block, seed 1005, before reads took the
// block range lock). Writers fill 64 KiB with one byte value each time;
// readers check that every 4 KiB block they see holds one value only.
// Bounded: 3 s or 20 000 reads per reader.
func TestReadNeverSeesATornBlock(t *testing.T) {
	s, err := replica.OpenStore(replica.Config{Dir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r, err := s.Create(replica.Spec{ID: "torn", VolumeID: "v", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	const span = 64 << 10
	var stop atomic.Bool
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := make([]byte, span)
			for i := 0; !stop.Load(); i++ {
				for j := range p {
					p[j] = byte(2*i + w + 1)
				}
				if err := r.WriteAt(op, p, 0); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	var torn atomic.Int64
	deadline := time.Now().Add(3 * time.Second)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := make([]byte, span)
			for n := 0; n < 20000 && time.Now().Before(deadline); n++ {
				if err := r.ReadAt(op, p, 0); err != nil {
					t.Error(err)
					return
				}
				for b := 0; b < span; b += replica.BlockSize {
					blk := p[b : b+replica.BlockSize]
					if !bytes.Equal(blk, bytes.Repeat(blk[:1], len(blk))) {
						torn.Add(1)
					}
				}
			}
		}()
	}
	time.Sleep(time.Until(deadline))
	stop.Store(true)
	wg.Wait()
	if n := torn.Load(); n > 0 {
		t.Fatalf("%d torn blocks read while writes overlapped", n)
	}
}
