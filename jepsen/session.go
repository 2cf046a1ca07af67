package jepsen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
)

// errClientDead: the client process ended (killed by a nemesis) before it
// answered.
var errClientDead = errors.New("jepsen: client process died")

// Session is the harness's side of one run of a client process.
type Session struct {
	proc *Proc

	wmu  sync.Mutex // serializes writes to the process's stdin
	enc  *json.Encoder
	mu   sync.Mutex // guards pending and next
	pend map[uint64]chan Response
	next uint64
	dead chan struct{}
}

// startSession starts p (a client process) and reads its answers.
func startSession(p *Proc) (*Session, error) {
	if err := p.Start(true); err != nil {
		return nil, err
	}
	s := &Session{proc: p, enc: json.NewEncoder(p.Stdin()), pend: map[uint64]chan Response{}, dead: make(chan struct{})}
	out := p.Stdout()
	go func() {
		defer close(s.dead)
		dec := json.NewDecoder(out)
		for {
			var r Response
			if err := dec.Decode(&r); err != nil {
				return
			}
			s.mu.Lock()
			ch := s.pend[r.ID]
			delete(s.pend, r.ID)
			s.mu.Unlock()
			if ch != nil {
				ch <- r
			}
		}
	}()
	return s, nil
}

// Call sends req and waits for its answer, ctx, or the process's death.
func (s *Session) Call(ctx context.Context, req Request) (Response, error) {
	ch := make(chan Response, 1)
	s.mu.Lock()
	s.next++
	req.ID = s.next
	s.pend[req.ID] = ch
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.pend, req.ID)
		s.mu.Unlock()
	}()
	s.wmu.Lock()
	err := s.enc.Encode(req)
	s.wmu.Unlock()
	if err != nil {
		return Response{}, fmt.Errorf("%w: %v", errClientDead, err)
	}
	select {
	case r := <-ch:
		return r, nil
	case <-s.dead:
		return Response{}, errClientDead
	case <-ctx.Done():
		return Response{}, ctx.Err()
	}
}

// Dead is closed when the process has gone.
func (s *Session) Dead() <-chan struct{} { return s.dead }

func (s *Session) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}
