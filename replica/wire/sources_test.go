package wire

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/replica"
)

// Sources under churn: many concurrent reads, a tiny Idle (the reap
// timer races acquire/release), reads that fail (past the end: the
// source is broken while others use it), reads cancelled while the source
// is being opened or read, and Close in the middle. Nothing may race,
// panic, or leave a connection open on the source's server.
func TestSourcesChurn(t *testing.T) {
	for round := range 5 {
		p := newCopyPair(t, time.Millisecond)
		o := replica.Op{Epoch: 1}
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for g := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(round), uint64(g)))
				buf := make([]byte, 4096)
				for {
					select {
					case <-stop:
						return
					default:
					}
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(3000))*time.Microsecond)
					off := int64(r.IntN(16)) * 4096
					if r.IntN(8) == 0 {
						off = testSize // past the end: the source refuses
					}
					_ = p.sources.ReadSource(ctx, OpenRequest{Replica: "dst"}, "src", o, buf, off)
					cancel()
					if r.IntN(4) == 0 {
						time.Sleep(time.Duration(r.IntN(3)) * time.Millisecond)
					}
				}
			}()
		}
		time.Sleep(300 * time.Millisecond)
		p.sources.Close()
		time.Sleep(50 * time.Millisecond)
		close(stop)
		wg.Wait()
		waitFor(t, "every source connection closed", func() bool { return p.srcH.srv.Stats().Conns == 0 })
		if n := p.sources.openCount(); n != 0 {
			t.Fatalf("%d sources left in the map after Close", n)
		}
	}
}
