package jepsen

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// memDevice is an in-memory nbd.Device whose flushes take a while and
// count how many run at once.
type memDevice struct {
	mu   sync.Mutex
	data []byte

	flushing, maxFlushing atomic.Int32
}

func (d *memDevice) ReadAt(_ context.Context, p []byte, off int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	copy(p, d.data[off:])
	return nil
}

func (d *memDevice) WriteAt(_ context.Context, p []byte, off int64, _ bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	copy(d.data[off:], p)
	return nil
}

func (d *memDevice) WriteZeroes(ctx context.Context, off, n int64, fua bool) error {
	return d.WriteAt(ctx, make([]byte, n), off, fua)
}

func (d *memDevice) Trim(ctx context.Context, off, n int64) error {
	return d.WriteZeroes(ctx, off, n, false)
}

func (d *memDevice) Flush(context.Context) error {
	n := d.flushing.Add(1)
	defer d.flushing.Add(-1)
	for {
		m := d.maxFlushing.Load()
		if n <= m || d.maxFlushing.CompareAndSwap(m, n) {
			break
		}
	}
	time.Sleep(20 * time.Millisecond)
	return nil
}

func (d *memDevice) Size() uint64 { return uint64(len(d.data)) }

// TestNBDConnsUnit: what goes over the client process's NBD connections
// reaches the device and reads back, from any connection, and flushes
// sent on several connections at once are in flight in the device
// together (what the flush-storm nemesis relies on).
func TestNBDConnsUnit(t *testing.T) {
	dev := &memDevice{data: make([]byte, 1<<20)}
	conns, err := serveNBD(dev, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer conns.close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4*NBDConns)
	for i := range NBDConns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			value := encodeValue(uint64(i+1), i, 7)
			if _, err := conns.call(ctx, Request{Op: "write", Conn: i + 1, Off: int64(i) * BlockSize, Data: value}); err != nil {
				errs <- err
				return
			}
			for range 3 {
				if _, err := conns.call(ctx, Request{Op: "flush", Conn: i + 1}); err != nil {
					errs <- err
					return
				}
			}
			// Read it back over another connection.
			got, err := conns.call(ctx, Request{Op: "read", Conn: (i+1)%NBDConns + 1, Off: int64(i) * BlockSize, Len: BlockSize})
			if err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(got, value) {
				t.Errorf("connection %d: block %d read back differs", (i+1)%NBDConns+1, i)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if m := dev.maxFlushing.Load(); m < 2 {
		t.Fatalf("at most %d flush in flight in the device at once; want several", m)
	}
	if _, err := conns.call(ctx, Request{Op: "flush", Conn: NBDConns + 1}); err == nil {
		t.Fatal("a request on a connection that does not exist succeeded")
	}
}
